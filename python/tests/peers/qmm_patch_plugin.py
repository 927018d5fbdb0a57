"""A pytest plugin for running another project's test suite with qmm in place: every bitsandbytes Linear4bit is
patched by qmm.patch_bnb as it is built, and the session ends with what qmm computed and what it left to
bitsandbytes (with the reasons). scripts/peer-tests loads it (pytest -p qmm_patch_plugin); with QMM_PEER_CONTROL=1
it does nothing, for the control run of the same tests."""
import collections
import os

_products = collections.Counter()  # "forward" / "backward": products qmm computed
_fallbacks = collections.Counter()  # reason -> calls left to the layer's own forward
_layers = [0]


def _active():
    return not os.environ.get("QMM_PEER_CONTROL")


def pytest_configure(config):
    if not _active():
        return
    import bitsandbytes as bnb

    import qmm
    from qmm import _impl, patch

    init = bnb.nn.Linear4bit.__init__

    def init_and_patch(self, *args, **kwargs):
        init(self, *args, **kwargs)
        qmm.patch_bnb(self)
        _layers[0] += 1

    bnb.nn.Linear4bit.__init__ = init_and_patch

    # Counted where they run (the eager autograd functions and the custom ops' bodies alike), outside any graph.
    def counted(fn, what):
        def wrapper(*args, **kwargs):
            _products[what] += 1
            return fn(*args, **kwargs)
        return wrapper

    _impl.linear_forward = counted(_impl.linear_forward, "forward")
    _impl.linear_backward = counted(_impl.linear_backward, "backward")
    fallback = patch._fallback

    def counted_fallback(module, why, *args, **kwargs):
        _fallbacks[why] += 1
        return fallback(module, why, *args, **kwargs)

    patch._fallback = counted_fallback


def pytest_terminal_summary(terminalreporter):
    if not _active():
        terminalreporter.write_line("qmm: control run (QMM_PEER_CONTROL set), nothing patched")
        return
    terminalreporter.write_line(f"qmm: {_layers[0]} Linear4bit layers patched as built; products by qmm: "
                                f"{_products['forward']} forward, {_products['backward']} backward; calls left to "
                                f"bitsandbytes: {sum(_fallbacks.values())}")
    for why, n in _fallbacks.most_common():
        terminalreporter.write_line(f"qmm:   {n} x {why}")
