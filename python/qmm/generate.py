"""Fast generation for a Hugging Face causal LM (patched by qmm.patch_bnb or not, LoRA adapters unmerged): one
static KV cache, reused by every call, and the one-token decode steps compiled with torch.compile, on a GPU with
mode="reduce-overhead", so that each decode step replays as CUDA graphs (qmm's custom ops inside them) instead of
one launch per kernel from Python. Eager decoding of a small model is bound by the host: Python, PEFT and the
launches take most of each token's time.

    decoder = qmm.static_decoder(model, max_cache_len=1024)
    out = decoder.generate(input_ids=ids, attention_mask=mask, max_new_tokens=64, do_sample=False)

The prefill runs eagerly, as transformers' own compiled generation does: a static cache makes its tensors in its
first call, which inside a CUDA graph would live in the graph's memory and be overwritten by the next replay. The
first calls compile (tens of seconds on a GPU); later calls replay, whatever their prompt length. Limits: prompt +
new tokens ≤ max_cache_len (a call that sets no length generates until the end of sequence or a full cache); the
batch size of the first call (the cache's tensors are made for it); the model's modules as they were when the
decoder was made (after patch_bnb/unpatch_bnb, merge_adapter or other adapters, make
a new decoder; parameters updated in place, as an optimizer's step does, are read as they are). The model is not
changed outside `generate` calls."""
import inspect

import torch

from . import compile_ops
from ._base import _error


class StaticDecoder:
    """See the module's documentation; made by qmm.static_decoder."""

    def __init__(self, model, max_cache_len, compile_kwargs):
        from transformers import StaticCache
        if not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool) or max_cache_len < 1:
            raise _error("InvalidArgument", f"static_decoder: max_cache_len must be a positive int, got "
                                            f"{max_cache_len!r}")
        self.model = model
        self.max_cache_len = max_cache_len
        self._batch = None  # the first call's: the cache's tensors are made for it
        self._base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.cache = StaticCache(config=self._base.config, max_cache_len=max_cache_len)
        params = inspect.signature(self._base.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._eager = self._base.forward
        self._prefilled = False
        self._compiled = None if compile_kwargs is None else torch.compile(self._eager, fullgraph=True,
                                                                           **compile_kwargs)

    def _forward(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        # The first call of a generate is the prefill, eager even for a one-token prompt: it fills the cache
        decode = self._prefilled and ids is not None and ids.shape[-1] == 1
        self._prefilled = True
        return (self._compiled if decode and self._compiled is not None else self._eager)(*args, **kwargs)

    def generate(self, input_ids, **kwargs):
        """model.generate(input_ids, **kwargs) through the static cache (reset first) and the compiled decode
        steps. A cache or cache_implementation of the caller's is refused: the decoder brings its own."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            what = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise _error("InvalidArgument", f"static_decoder.generate: input_ids must be a [batch, tokens] tensor, "
                                            f"got {what}")
        if self._batch is not None and input_ids.shape[0] != self._batch:
            raise _error("InvalidArgument", f"static_decoder.generate: a batch of {input_ids.shape[0]} where the "
                                            f"decoder's cache holds {self._batch} (the first call's); make a new "
                                            f"decoder for another batch size")
        for name in ("past_key_values", "cache", "cache_implementation", "use_cache"):
            if name in kwargs:
                raise _error("InvalidArgument", f"static_decoder.generate: {name} is the decoder's own; pass "
                                                "neither a cache nor a cache setting")
        # The length generate will reach (its arguments, else the model's generation config; where neither sets
        # one, as far as the cache reaches): past the cache's end a static cache has no room, so a longer call is
        # refused here rather than left to fail inside the model.
        config = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
        prompt = input_ids.shape[-1]
        total = prompt + new if new is not None else kwargs.get("max_length", getattr(config, "max_length", None))
        if total is None:
            kwargs["max_new_tokens"] = total = max(self.max_cache_len - prompt, 0)
            new, total = total, prompt + total
        if total > self.max_cache_len or prompt >= self.max_cache_len:
            what = f"max_new_tokens {new}" if new is not None else f"max_length {total}"
            raise _error("InvalidArgument", f"static_decoder.generate: {prompt} prompt tokens and {what} exceed "
                                            f"max_cache_len {self.max_cache_len}")
        self.cache.reset()
        self._batch = input_ids.shape[0]
        self._prefilled = False
        base = self._base
        had_own = "forward" in base.__dict__
        own = base.__dict__.get("forward")
        base.forward = self._forward
        try:
            with torch.no_grad():
                return self.model.generate(input_ids=input_ids, **{self._cache_arg: self.cache}, **kwargs)
        finally:
            if had_own:
                base.forward = own
            else:
                del base.forward


def static_decoder(model, max_cache_len, compile_kwargs="default"):
    """A StaticDecoder for `model` (see qmm.generate): `.generate(input_ids, **generate_kwargs)` with a static KV
    cache of max_cache_len tokens and the decode steps compiled. compile_kwargs: torch.compile's arguments for the
    decode step ("default": mode="reduce-overhead" for a model on a GPU, no compilation on the CPU, where
    there are no graphs to replay; None: never compile)."""
    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "generate", None)) or \
            getattr(model, "config", None) is None:
        raise _error("InvalidArgument", f"static_decoder: model must be a Hugging Face generative model (a module "
                                        f"with .generate and .config), got a {type(model).__name__}")
    param = next(model.parameters(), None)
    if param is None:
        raise _error("InvalidArgument", "static_decoder: the model has no parameters")
    if compile_kwargs is not None and compile_kwargs != "default" and not isinstance(compile_kwargs, dict):
        raise _error("InvalidArgument", f"static_decoder: compile_kwargs must be a dict of torch.compile's "
                                        f"arguments, \"default\" or None, got {compile_kwargs!r}")
    if compile_kwargs == "default":
        on_gpu = param.is_cuda
        compile_kwargs = dict(mode="reduce-overhead") if on_gpu else None
    if compile_kwargs is not None and not compile_ops.AVAILABLE:
        raise _error("Unsupported", "static_decoder: compiling the decode step with qmm's ops needs PyTorch 2.4 or "
                                    "newer (pass compile_kwargs=None to decode with the static cache alone)")
    return StaticDecoder(model, max_cache_len, compile_kwargs)
