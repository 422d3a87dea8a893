"""Encoders on batches of a tiny synthetic benchmark: shapes, masks, invariances, gradients,
independent re-computations, and the pretrained paths' errors (no network)."""

import pytest
import timm
import torch
import torch.nn as nn

from course_lib.core.encoders import (
    BagOfWordsEncoder,
    BertTextEncoder,
    BiGRUEncoder,
    EncoderOutput,
    PixelEncoder,
    RegionTransformerEncoder,
    build_image_encoder,
    build_text_encoder,
    count_parameters,
    l2_normalize,
    word_mask,
)
from course_lib.data.datasets import CaptionDataset, ImageDataset, make_loader
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer

B = 6


@pytest.fixture(scope="module")
def bench():
    cfg = SyntheticConfig.smoke(n_train=12, n_val=2, n_test=2, n_pretrain=2, n_compositional=1)
    return make_benchmark(cfg, seed=0)


@pytest.fixture(scope="module")
def tok(bench):
    return build_word_tokenizer(bench["train"].captions)


@pytest.fixture(scope="module")
def region_batch(bench):
    return next(iter(make_loader(ImageDataset(bench["train"], "regions"), B)))


@pytest.fixture(scope="module")
def pixel_batch(bench):
    return next(iter(make_loader(ImageDataset(bench["train"], "pixels"), B)))


@pytest.fixture(scope="module")
def text_batch(bench, tok):
    return next(iter(make_loader(CaptionDataset(bench["train"]), B, tokenizer=tok)))


def text_encoders(vocab_size):
    torch.manual_seed(0)
    return {"bow": BagOfWordsEncoder(vocab_size, hidden=16),
            "gru": BiGRUEncoder(vocab_size, embed_dim=12, hidden=16),
            "bert": BertTextEncoder(vocab_size, hidden=16, layers=2, heads=2, max_length=48)}


@pytest.fixture(scope="module")
def text_models(tok):
    return text_encoders(len(tok))


def check_output(out, batch_size, length, dim, mask=None):
    assert isinstance(out, EncoderOutput)
    assert out.tokens.shape == (batch_size, length, dim)
    assert out.mask.shape == (batch_size, length) and out.mask.dtype == torch.bool
    assert out.pooled.shape == (batch_size, dim)
    assert torch.isfinite(out.tokens).all() and torch.isfinite(out.pooled).all()
    if mask is not None:
        assert torch.equal(out.mask, mask)
    assert (out.tokens[~out.mask] == 0).all()  # padded positions are exactly zero


def missing_grads(model, out):
    model.zero_grad()
    out.pooled.sum().backward()
    return [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]


# ------------------------------------------------------------------------------------------ helpers

def test_l2_normalize_and_count_parameters():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    y = l2_normalize(x)
    assert torch.allclose(y[0], torch.tensor([0.6, 0.8])) and (y[1] == 0).all()
    assert count_parameters(nn.Linear(3, 2)) == 8
    frozen = nn.Linear(3, 2).requires_grad_(False)
    assert count_parameters(frozen) == 0 and count_parameters(frozen, trainable_only=False) == 8


def test_factories(bench, tok):
    D = bench["train"].regions.shape[-1]
    assert isinstance(build_image_encoder("regions", region_dim=D, hidden=16, heads=2),
                      RegionTransformerEncoder)
    assert isinstance(build_text_encoder("gru", len(tok), hidden=8), BiGRUEncoder)
    with pytest.raises(ValueError, match="pixels.*regions|regions.*pixels"):
        build_image_encoder("resnet")
    with pytest.raises(ValueError, match="bert.*bow.*gru"):
        build_text_encoder("lstm", len(tok))


# ------------------------------------------------------------------------------------------ regions

@pytest.fixture(scope="module")
def region_model(bench):
    torch.manual_seed(0)
    region_dim = bench["train"].regions.shape[-1]
    return RegionTransformerEncoder(region_dim, hidden=32, layers=2, heads=4).eval()


def test_region_encoder_shapes_and_mask(region_model, region_batch):
    R = region_batch["regions"].shape[1]
    assert not region_batch["region_mask"].all()  # the smoke scenes have 4-5 objects: some padding
    out = region_model(region_batch)
    mask = torch.cat([torch.ones(B, 1, dtype=torch.bool), region_batch["region_mask"]], 1)
    check_output(out, B, 1 + R, 32, mask)
    assert torch.equal(out.pooled, out.tokens[:, 0])  # pooled = [CLS] output


def test_region_encoder_permutation_invariant(region_model, region_batch):
    perm = torch.randperm(region_batch["regions"].shape[1],
                          generator=torch.Generator().manual_seed(1))
    shuffled = {k: region_batch[k][:, perm] for k in ("regions", "boxes", "region_mask")}
    with torch.no_grad():
        out, out_perm = region_model(region_batch), region_model(shuffled)
    torch.testing.assert_close(out_perm.pooled, out.pooled, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_perm.tokens[:, 1:], out.tokens[:, 1:][:, perm],
                               atol=1e-5, rtol=1e-5)


def test_region_encoder_ignores_padded_content(region_model, region_batch):
    pad = ~region_batch["region_mask"]  # (B, R)
    noisy = dict(region_batch)
    noisy["regions"] = (region_batch["regions"].masked_fill(pad.unsqueeze(-1), 0.0)
                        + 100 * pad.unsqueeze(-1))
    noisy["boxes"] = torch.where(pad.unsqueeze(-1), torch.rand_like(region_batch["boxes"]),
                                 region_batch["boxes"])
    with torch.no_grad():
        out, out_noisy = region_model(region_batch), region_model(noisy)
    torch.testing.assert_close(out_noisy.pooled, out.pooled, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_noisy.tokens, out.tokens, atol=1e-5, rtol=1e-5)


def test_region_encoder_gradients(region_model, region_batch):
    region_model.train()
    try:
        assert missing_grads(region_model, region_model(region_batch)) == []
    finally:
        region_model.eval()


# ------------------------------------------------------------------------------------------- pixels

def test_tiny_vit_on_32px(pixel_batch):
    torch.manual_seed(0)
    model = PixelEncoder().eval()
    assert pixel_batch["pixels"].shape == (B, 3, 32, 32)
    out = model(pixel_batch)
    check_output(out, B, 1 + 8 * 8, 64, torch.ones(B, 65, dtype=torch.bool))  # [CLS] + 8x8 patches
    assert torch.equal(out.pooled, out.tokens[:, 0])  # ViT: pooled = [CLS]
    model.train()
    assert missing_grads(model, model(pixel_batch)) == []


def test_pixel_encoder_projection_and_cnn(pixel_batch):
    torch.manual_seed(0)
    vit = PixelEncoder(out_dim=24, depth=1)
    assert vit.out_dim == 24 and len(vit.backbone.blocks) == 1
    check_output(vit(pixel_batch), B, 65, 24)
    cnn = PixelEncoder("resnet18", pretrained=False).eval()
    with torch.no_grad():
        out = cnn({"pixels": torch.randn(2, 3, 64, 64)})
    check_output(out, 2, 2 * 2, 512)  # 64 px / stride 32 = a 2x2 grid
    torch.testing.assert_close(out.pooled, out.tokens.mean(1))  # CNN: pooled = mean over the grid


def test_pixel_encoder_errors(monkeypatch):
    with pytest.raises(ValueError, match="no model"):
        PixelEncoder("not_a_timm_model")
    with pytest.raises(ValueError, match="no pretrained weights"):
        PixelEncoder(pretrained=True)

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(timm, "create_model", offline)
    with pytest.raises(OSError, match="internet.*pretrained=False") as info:
        PixelEncoder("resnet18", pretrained=True)
    assert isinstance(info.value.__cause__, OSError)


# -------------------------------------------------------------------------------------------- texts

def test_text_encoder_shapes_and_gradients(text_models, text_batch):
    T = text_batch["input_ids"].shape[1]
    assert not text_batch["attention_mask"].all()  # captions of different lengths: some padding
    for name, model in text_models.items():
        out = model(text_batch)
        check_output(out, B, T, 16, text_batch["attention_mask"].bool())
        assert model.out_dim == 16
        assert missing_grads(model, out) == [], name


def pad_with_longer(batch, extra=5):
    """The same captions batched with a caption `extra` tokens longer than the longest."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    B, T = ids.shape
    longer = torch.tensor([[2] + [7] * (T + extra - 2) + [3]])  # [CLS] word ... word [SEP]
    ids2 = torch.cat([torch.cat([ids, torch.zeros(B, extra, dtype=ids.dtype)], 1), longer])
    am2 = torch.cat([torch.cat([am, torch.zeros(B, extra, dtype=am.dtype)], 1),
                     torch.ones(1, T + extra, dtype=am.dtype)])
    return {"input_ids": ids2, "attention_mask": am2}


def test_text_encoders_padding_invariant(text_models, text_batch):
    padded = pad_with_longer(text_batch)
    T = text_batch["input_ids"].shape[1]
    for name, model in text_models.items():
        model.eval()
        with torch.no_grad():
            out, out_padded = model(text_batch), model(padded)
        torch.testing.assert_close(out_padded.pooled[:B], out.pooled, atol=1e-5,
                                   rtol=1e-5, msg=name)
        torch.testing.assert_close(out_padded.tokens[:B, :T], out.tokens, atol=1e-5,
                                   rtol=1e-5, msg=name)
        assert (out_padded.tokens[:B, T:] == 0).all(), name


def test_bow_is_explicit_mean_over_words(text_models, text_batch):
    model = text_models["bow"]
    out = model(text_batch)
    for b in range(B):
        ids = text_batch["input_ids"][b][text_batch["attention_mask"][b].bool()]
        assert ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP]
        expected = model.embed.weight[ids[1:-1]].mean(0)
        torch.testing.assert_close(out.pooled[b], expected)
    assert torch.equal(word_mask(text_batch["input_ids"], text_batch["attention_mask"]).sum(1),
                       text_batch["attention_mask"].sum(1) - 2)


def test_bigru_matches_unpacked_single_sequences(text_models, text_batch):
    model = text_models["gru"].eval()
    with torch.no_grad():
        out = model(text_batch)
        H = model.hidden
        for b in range(B):
            n = int(text_batch["attention_mask"][b].sum())
            # (1, n, E) no padding at all
            x = model.embed(text_batch["input_ids"][b, :n]).unsqueeze(0)
            seq, h_n = model.gru(x)  # (1, n, 2H), (2, 1, H)
            torch.testing.assert_close(out.tokens[b, :n], (seq[0, :, :H] + seq[0, :, H:]) / 2)
            # final states: forward after the last word, backward after the first
            torch.testing.assert_close(h_n[0, 0], seq[0, -1, :H])
            torch.testing.assert_close(h_n[1, 0], seq[0, 0, H:])
            torch.testing.assert_close(out.pooled[b], (h_n[0, 0] + h_n[1, 0]) / 2)


def test_bert_pooled_is_cls_last_hidden_state(text_models, text_batch, tok):
    model = text_models["bert"].eval()
    assert model.bert.pooler is None and model.bert.config.pad_token_id == 0
    assert model.bert.config.vocab_size == len(tok)
    with torch.no_grad():
        out = model(text_batch)
        raw = model.bert(input_ids=text_batch["input_ids"],
                         attention_mask=text_batch["attention_mask"])
    torch.testing.assert_close(out.pooled, raw.last_hidden_state[:, 0])
    with pytest.raises(ValueError, match="positions"):
        model({"input_ids": torch.full((1, 60), 5),
               "attention_mask": torch.ones(1, 60, dtype=torch.long)})


def test_bert_pretrained_error_offline(monkeypatch):
    from transformers import BertModel

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(BertModel, "from_pretrained", offline)
    with pytest.raises(OSError, match="internet.*pretrained_name=None") as info:
        BertTextEncoder(30522, pretrained_name="bert-base-uncased")
    assert isinstance(info.value.__cause__, OSError)


def test_l2_normalize_has_finite_gradients_at_zero_vectors():
    from course_lib.core.encoders import l2_normalize

    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], requires_grad=True)
    y = l2_normalize(x)
    assert (torch.allclose(y[0], torch.tensor([0.6, 0.8]), atol=1e-6)
            and torch.equal(y[1], torch.zeros(2)))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_transformer_encoders_share_the_course_block_and_return_every_layer():
    # the region and text encoders are built from course_lib.core.blocks, and
    # hand back each block's states
    from course_lib.core.blocks import Transformer
    from course_lib.core.encoders import TransformerTextEncoder

    torch.manual_seed(0)
    text = TransformerTextEncoder(vocab_size=30, hidden=16, layers=3, heads=2).eval()
    regions = RegionTransformerEncoder(region_dim=8, hidden=16, layers=2, heads=2).eval()
    assert (isinstance(text.transformer, Transformer)
            and isinstance(regions.transformer, Transformer))
    batch = {"input_ids": torch.tensor([[2, 7, 9, 3, 0], [2, 5, 3, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])}
    out = text(batch, return_layers=True)
    assert len(out.layers) == 3 and out.layers[0].shape == (2, 5, 16)
    torch.testing.assert_close(out.tokens[out.mask], out.layers[-1][out.mask])
    assert (out.tokens[~out.mask] == 0).all() and torch.equal(out.pooled, out.tokens[:, 0])
    longer = {k: torch.cat([v, torch.zeros(2, 3, dtype=v.dtype)], 1) for k, v in batch.items()}
    torch.testing.assert_close(text(longer).pooled, out.pooled)  # padding changes nothing
    image = {"regions": torch.randn(2, 4, 8), "boxes": torch.rand(2, 4, 7),
             "region_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)}
    assert len(regions(image, return_layers=True).layers) == 2 and regions(image).layers is None
