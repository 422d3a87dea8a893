"""The course's GPU paths, run where CUDA is available and skipped elsewhere (issue 12, part 5).

course_lib.core.train.Trainer's mixed precision (autocast to bfloat16 where the GPU supports it,
else float16 with a GradScaler) and the `.to(device)` of course_lib.methods.base' encoders. CUDA
events (course_lib.core.timing), SCAN and exact search on CUDA have their own tests in
test_timing.py, test_scan.py and test_retrieval.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from course_lib.core.train import Trainer
from course_lib.core.train_config import TrainConfig
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.encoding import encode_captions, encode_gallery
from course_lib.methods.vsepp import VsePPConfig, build_dual_encoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _regression():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)  # (64, 16)
    return TensorDataset(x, x @ torch.randn(16, generator=g))  # targets (64,)


@pytest.mark.parametrize("bf16", [True, False], ids=["bfloat16", "float16+GradScaler"])
def test_trainer_amp_step_on_cuda(bf16, monkeypatch):
    if bf16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    # pick the path under test
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    seen = []

    def loss_fn(model, batch, step):
        x, y = batch
        pred = model(x).squeeze(-1)  # (B,) in the autocast dtype
        seen.append((pred.dtype, x.device.type))
        return ((pred.float() - y) ** 2).mean()

    # float16: GradScaler starts at a scale of 2**16 and skips each step whose scaled
    # gradients overflow, halving the scale, so the first steps may not move the
    # weights: give it room to back off
    steps = 2 if bf16 else 12
    config = TrainConfig(max_steps=steps, batch_size=16, lr=1e-2, warmup_fraction=0.0, log_every=1,
                         progress=False, device="cuda", amp=True)
    trainer = Trainer(model, loss_fn, _regression(), config)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    assert trainer.use_amp and trainer.amp_dtype == (torch.bfloat16 if bf16 else torch.float16)
    assert trainer.scaler.is_enabled() == (not bf16)  # only float16 needs loss scaling
    history = trainer.fit()
    losses = history.column("loss", eval=False)
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    # the forward ran under autocast
    assert seen and all(s == (trainer.amp_dtype, "cuda") for s in seen)
    after = trainer.model.state_dict()
    # master weights
    assert all(after[k].device.type == "cuda" and after[k].dtype == torch.float32 for k in after)
    assert any(not torch.equal(after[k], before[k]) for k in before)  # the optimizer stepped
    if not bf16:
        assert 0 < trainer.scaler.get_scale() <= 2.0 ** 16


def test_trainer_without_amp_on_cuda_stays_float32():
    seen = []

    def loss_fn(model, batch, step):
        pred = model(batch[0]).squeeze(-1)
        seen.append(pred.dtype)
        return ((pred - batch[1]) ** 2).mean()

    trainer = Trainer(nn.Linear(16, 1), loss_fn, _regression(),
                      TrainConfig(max_steps=1, batch_size=16, progress=False,
                                  device="cuda", amp=False))
    trainer.fit()
    assert not trainer.use_amp and seen == [torch.float32]


def test_encoders_on_cuda_match_the_cpu():
    bench = make_benchmark(SyntheticConfig.smoke(n_train=12, n_val=2, n_test=6, n_pretrain=0,
                                                 n_compositional=1), seed=0)
    split, tokenizer = bench["test"], build_word_tokenizer(bench["train"].captions)
    torch.manual_seed(0)
    config = VsePPConfig(hidden=16, embed_dim=16, layers=1)
    model = build_dual_encoder(config, bench["train"], tokenizer).eval()
    # (N, E), (T, E)
    cpu_images, cpu_texts = encode_gallery(model, split), encode_captions(model, split, tokenizer)
    gpu_images = encode_gallery(model, split, device="cuda")
    gpu_texts = encode_captions(model.cuda(), split, tokenizer)  # None = the model's device
    assert gpu_images.device.type == gpu_texts.device.type == "cpu"  # results come back to the CPU
    torch.testing.assert_close(gpu_images, cpu_images, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(gpu_texts, cpu_texts, rtol=1e-3, atol=1e-4)
