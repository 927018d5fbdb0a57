"""A whole training step (forward, backward, optimizer step) replayed as one CUDA graph.

A patched QLoRA step of a small model spends most of its wall time on the host (Python, autograd, one launch per
kernel) while the GPU waits. Captured once, the step replays with one launch:

    opt = torch.optim.AdamW(params, lr=1e-4, capturable=True)   # fused=True too if wanted: capturable is what counts

    def step(input_ids, labels):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    step = qmm.graph_step(step)
    for batch in loader:
        loss = step(batch["input_ids"].cuda(), batch["labels"].cuda())   # a tensor the next call overwrites

Limits: the step's inputs are tensors and every other value the step reads is fixed at capture (Python numbers,
the learning rate unless the optimizer keeps it in a tensor, which layers run). Each new input signature (shapes,
dtypes, strides, device) runs `warmup` eager steps and then captures a graph of its own, with memory of its own
(pad batches to a few fixed shapes). The step may not synchronize with the host (`.item()`, printing a tensor,
data-dependent shapes, a checked label count: qmm's fused loss skips that check while capturing) and its outputs
are overwritten by the next replay (clone what you keep); they come without autograd history (eager calls' too,
in the same containers: tensors, tuples, lists, dicts, a transformers ModelOutput).
A loss of an eager step run before on another stream (PyTorch's default one) that is still referenced when the
graph is captured keeps that step's gradient accumulators, tied to that stream, in use: let it go (`loss.item()`
or `loss.detach()` keep the value) before the step's first calls. Hugging Face models check an attention mask's
values (and, building no KV cache, the position ids) to skip the mask when nothing is padded or packed, which they
cannot do while capturing: pass no attention_mask for unpadded batches, and without a KV cache patch the model
with patch_bnb(fused_loss=True), or the graph holds the explicit-mask attention. On the CPU the step runs eagerly.

Capturing qmm's ops with torch.cuda.graph yourself: warm them up on the stream you capture on (qmm keeps a context
per stream; graph_step does this)."""
import copy

import torch

from . import _copies
from ._base import _error


class GraphStep:
    """See the module's documentation; made by qmm.graph_step."""

    def __init__(self, step, warmup):
        self._step = step
        self._warmup = warmup
        self._entries = {}  # input signature -> _Capture
        self._side_streams = {}  # device -> the stream the warm-up calls run on

    def __call__(self, *inputs):
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise _error("InvalidArgument", f"graph_step: input {i} is a {type(t).__name__}; the step's inputs "
                                                "must be tensors (other values are fixed when the step is captured)")
        if len({t.device for t in inputs}) > 1:
            raise _error("InvalidArgument", "graph_step: the inputs are on different devices: "
                                            + ", ".join(str(t.device) for t in inputs))
        if not inputs or not inputs[0].is_cuda:
            return _detached(self._step(*inputs))
        device = inputs[0].device
        key = tuple((tuple(t.shape), t.dtype, t.stride()) for t in inputs) + (device,)
        entry = self._entries.get(key)
        if entry is None:
            if device not in self._side_streams:  # one per device: qmm keeps a context per stream it sees
                self._side_streams[device] = torch.cuda.Stream(device)
            entry = self._entries[key] = _Capture(device, self._side_streams[device])
        if entry.eager_calls < self._warmup:
            entry.eager_calls += 1
            return entry.run_eagerly(self._step, inputs)
        if entry.graph is None:
            entry.capture(self._step, inputs)
        return entry.replay(inputs)

    @property
    def captured(self):
        """How many graphs this step holds (one per input signature that finished its warm-up)."""
        return sum(e.graph is not None for e in self._entries.values())


class _Capture:
    def __init__(self, device, side_stream):
        self.device = device
        self.side = side_stream
        self.eager_calls = 0
        self.graph = None
        self.inputs = None
        self.outputs = None

    def run_eagerly(self, step, inputs):
        # On a side stream, as the capture will run: lazy set-up (the optimizer's state, cuBLAS workspaces, qmm's
        # context for that stream) happens here, outside the graph.
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            out = _detached(step(*inputs))
        current.wait_stream(self.side)
        return out

    def capture(self, step, inputs):
        self.inputs = [t.clone() for t in inputs]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        try:
            # On the stream the warm-up ran on: qmm keeps a context (cuBLASLt handle, plans) per stream, and a fresh
            # one would do its first-use set-up of large GEMM kernels inside the capture, which that cannot hold.
            # The adapters' working copies cast inside the capture: each replay casts them again (qmm._copies).
            with torch.cuda.graph(graph, stream=self.side), _copies.capturing():
                self.outputs = _detached(step(*self.inputs))
        except Exception as e:  # what the step did that a graph cannot hold; the message says which call
            raise _error("Unsupported", f"graph_step: the step could not be captured into a CUDA graph: {e}. A "
                                        "captured step may not synchronize with the host (.item(), printing a "
                                        "tensor, data-dependent shapes), needs a capturable optimizer "
                                        "(capturable=True, fused or not), and no loss of an eager step run on "
                                        "another stream may still be referenced (see qmm.graphs)") from e
        self.graph = graph

    def replay(self, inputs):
        for static, t in zip(self.inputs, inputs):
            if static.data_ptr() != t.data_ptr():
                static.copy_(t)
        self.graph.replay()
        return self.outputs


def _detached(out):
    """The step's outputs without their autograd graphs, in the same containers (tuples, named ones, lists, dicts and
    their subclasses such as transformers' ModelOutput): a returned loss would hold its step's graph, and with it
    PyTorch's gradient accumulators of the stream that step ran on, into the next call (the capture)."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, tuple):
        items = [_detached(o) for o in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        return type(out)(_detached(o) for o in out)
    if isinstance(out, dict):
        copied = copy.copy(out)
        for k, v in out.items():
            copied[k] = _detached(v)
        return copied
    return out


def graph_step(step, warmup=2):
    """Wraps a training step `step(*tensors)` so that it replays as one CUDA graph after `warmup` eager calls per
    input signature (see qmm.graphs for the limits). Returns a callable with step's signature."""
    if not callable(step):
        raise _error("InvalidArgument", f"graph_step: step must be callable, got a {type(step).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise _error("InvalidArgument", f"graph_step: warmup must be an int >= 1 (the optimizer's state and lazy "
                                        f"set-up happen outside the graph), got {warmup!r}")
    return GraphStep(step, warmup)
