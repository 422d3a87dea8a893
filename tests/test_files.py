"""Two processes, one checkpoint folder (course_lib.core.files): one trains, the other waits and
loads; nothing either writes is ever half a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from course_lib.core.files import lock_file, temporary_name, training_lock, write_atomically

ROOT = Path(__file__).resolve().parents[1]

# a tiny VSE++ trained into a shared cache folder; prints how many steps this process trained itself
TRAIN_ONE = textwrap.dedent("""
    import json, sys, time
    from course_lib.core.train import Trainer
    from course_lib.data.synthetic import SyntheticConfig, make_benchmark
    from course_lib.data.tokenizer import build_word_tokenizer
    from course_lib.methods.vsepp import VsePPConfig, VsePPMethod

    bench = make_benchmark(SyntheticConfig.smoke(n_train=40, n_val=8, n_test=8, n_pretrain=8,
                                                 n_compositional=2), seed=0)
    tokenizer = build_word_tokenizer(bench["train"].captions + bench["pretrain"].captions)
    steps, step = [], Trainer._train_step

    # long enough that the other process arrives while this one trains
    def slow_step(self, batches):
        steps.append(1)
        time.sleep(0.05)
        return step(self, batches)

    Trainer._train_step = slow_step
    method = VsePPMethod(VsePPConfig.smoke(max_steps=40, batch_size=16), progress=False)
    method.fit(bench, tokenizer, cache_dir=sys.argv[1])
    weights = sum(float(p.double().sum()) for p in method.model.state_dict().values())
    print(json.dumps({"trained_steps": len(steps), "file": method.checkpoint_path.name,
                      "weights": weights}))
""")


def test_two_processes_training_one_model_train_it_once(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "COURSE_SMOKE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", TRAIN_ONE, str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    seen = set()
    while any(p.poll() is None for p in procs):  # whatever either has written must load whole
        for path in cache.glob("*.pt") if cache.exists() else ():
            try:
                torch.load(path, map_location="cpu", weights_only=True)
            except FileNotFoundError:
                continue  # replaced between glob and load
            seen.add(path.name)
        time.sleep(0.05)
    outputs = [p.communicate() for p in procs]
    for p, (_out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-2000:]
    runs = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    # one trained all of it, the other none
    assert sorted(r["trained_steps"] for r in runs) == [0, 40]
    assert runs[0]["file"] == runs[1]["file"] and runs[0]["weights"] == runs[1]["weights"]
    assert seen <= {runs[0]["file"]}
    # the model, whole, and nothing else
    assert [p.name for p in cache.iterdir()] == [runs[0]["file"]]


def test_a_failed_write_leaves_neither_the_file_nor_a_temporary(tmp_path):
    target = tmp_path / "model.pt"

    def fails(path):
        path.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, fails)
    assert list(tmp_path.iterdir()) == []
    write_atomically(target, lambda path: path.write_bytes(b"whole"))
    assert target.read_bytes() == b"whole" and [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_temporary_names_differ_per_process(tmp_path):
    other = subprocess.run([sys.executable, "-c",
                            "import sys; from course_lib.core.files import temporary_name; "
                            "print(temporary_name(sys.argv[1]))", str(tmp_path / "a.pt")],
                           capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    mine = temporary_name(tmp_path / "a.pt")
    assert (mine.parent == tmp_path and mine.name.startswith(".a.pt.")
            and str(mine) != other.stdout.strip())


def test_the_lock_leaves_the_checkpoint_folder_to_the_models(tmp_path):
    (tmp_path / "sub").mkdir()
    with training_lock(tmp_path / "sub" / "m.pt"):
        assert (lock_file(tmp_path / "sub" / "m.pt").exists()
                and list((tmp_path / "sub").iterdir()) == [])
    assert lock_file(tmp_path / "sub" / "m.pt") != lock_file(tmp_path / "other" / "m.pt")
    with training_lock(None):
        pass
