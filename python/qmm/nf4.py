"""Nf4Weight: a frozen weight in bitsandbytes' NF4 layout, as qmm's NF4 ops take it."""
import json
import types

import torch

from . import _qmm
from ._base import _call, _dim, _error, _flag, _in, _int, _tensors

NF4_NESTED_BLOCK_SIZE = 256  # blocks per absmax2 group when double-quantized (bitsandbytes' nested block size)
NF4_CODEBOOK = tuple(_qmm.nf4_codebook())  # the 16 NF4 values (float32), bitsandbytes' quant_map for nf4
_FILE_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
                torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
                torch.bool: "BOOL"}  # safetensors' names, as qmm's checkpoint loader checks them



def _as_bytes(packed):
    """Packed NF4 codes as uint8: bitsandbytes may store them in another dtype (quant_storage, e.g. bfloat16 for
    FSDP), the same bytes."""
    return packed if packed.dtype == torch.uint8 else packed.detach().contiguous().view(torch.uint8)


class Nf4Weight:
    """A frozen weight W [rows, cols] = [out_features, in_features] in NF4, bitsandbytes' layout (docs/FORMAT.md):
    codes uint8 [ceil(rows*cols/2)] (element 2i in the high nibble of byte i) and one scale per block of
    block_size elements: absmax float32 [nblocks] (plain), or absmax uint8 [nblocks] indexing code2 float32 [256],
    scaled by absmax2 float32 [ceil(nblocks/256)] plus offset (double-quantized). All tensors on one device."""

    def __init__(self, codes, absmax, shape, block_size=64, absmax2=None, code2=None, offset=0.0):
        # Kept as qmm takes them, once: detached, dense and flat (views of the given tensors where they are dense),
        # and converted for the ops once (`_native`, which checks every field against the others: a weight built
        # from inconsistent parts fails here, not at its first use). Treat it as immutable.
        for name, t in (("codes", codes), ("absmax", absmax), ("absmax2", absmax2), ("code2", code2)):
            if not (isinstance(t, torch.Tensor) or (t is None and name in ("absmax2", "code2"))):
                raise _error("InvalidArgument", f"Nf4Weight: argument '{name}' must be a torch.Tensor, not "
                                                f"{type(t).__name__}")
        if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 2 or \
                not all(isinstance(v, int) and not isinstance(v, bool) for v in shape):
            raise _error("InvalidArgument", f"Nf4Weight: shape (rows, cols) must be two ints, got {shape!r}")
        try:
            shape = (int(shape[0]), int(shape[1]))
            block_size, offset = int(block_size), float(offset)
        except (TypeError, ValueError, IndexError, OverflowError) as e:
            raise _error("InvalidArgument", f"Nf4Weight: shape (rows, cols), block_size and offset must be numbers "
                                            f"({e})") from None
        if not all(-2 ** 63 <= v < 2 ** 63 for v in shape) or not -2 ** 31 <= block_size < 2 ** 31:
            raise _error("InvalidArgument", f"Nf4Weight: shape {shape} or block size {block_size} overflows qmm's "
                                            f"integers")
        if absmax.dtype == torch.float32 and (absmax2 is not None or code2 is not None or offset != 0.0):
            raise _error("InvalidArgument", "Nf4Weight: a float32 absmax is a plain weight's, which takes no absmax2, "
                                            "code2 or offset (a double-quantized weight's absmax is uint8)")
        flat = lambda t: None if t is None else _in(t).reshape(-1)  # noqa: E731
        self.codes, self.absmax, self.absmax2, self.code2 = flat(codes), flat(absmax), flat(absmax2), flat(code2)
        self.shape, self.block_size, self.offset = shape, block_size, offset
        # The offset for the custom ops (torch.compile): a float argument would compile one graph per value (per
        # layer), a tensor only per shape and dtype.
        self._offset_arg = torch.tensor(self.offset, dtype=torch.float64)
        self._native = _qmm.nf4_handle(self)

    # Copies and pickles (copy.deepcopy, torch.save of a module holding one) take the tensors; the native handle,
    # which views them, is made again.
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_native"}

    def __setstate__(self, state):
        # Made again through the constructor's checks: a malformed pickle is a qmm.Error like a malformed weight.
        if not isinstance(state, dict) or not {"codes", "absmax", "shape", "block_size"} <= state.keys():
            raise _error("InvalidArgument", "Nf4Weight: the pickled state lacks the weight's fields")
        fresh = Nf4Weight(state["codes"], state["absmax"], state["shape"], state["block_size"], state.get("absmax2"),
                          state.get("code2"), state.get("offset", 0.0))
        self.__dict__.update(fresh.__dict__)

    def op_args(self):
        """The weight as compile_ops' custom ops take it: its tensors and fields (see compile_ops.py)."""
        return (self.codes, self.absmax, self.absmax2, self.code2, self._offset_arg, self.shape[0], self.shape[1],
                self.block_size)

    @property
    def double_quant(self):
        return self.absmax.dtype == torch.uint8

    @property
    def device(self):
        return self.codes.device

    @property
    def nbytes(self):
        """Bytes the weight occupies (codes and scales): about 0.52 per element double-quantized, 0.56 plain."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.absmax, self.absmax2, self.code2)
                   if t is not None)

    def __repr__(self):
        scales = "double-quantized" if self.double_quant else "plain"
        return (f"Nf4Weight(shape={self.shape}, block_size={self.block_size}, {scales}, device={self.device}, "
                f"{self.nbytes} bytes)")

    @classmethod
    def quantize(cls, w, double_quant=True, block_size=64):
        """NF4 of w [rows, cols] (float32, bfloat16 or float16), byte-identical to bitsandbytes' quantize_4bit."""
        _flag("Nf4Weight.quantize", "double_quant", double_quant)
        _int("Nf4Weight.quantize", "block_size", block_size, 1, 2 ** 31 - 1)
        _tensors("Nf4Weight.quantize", w=w)
        w = _in(w)
        rows, cols = _dim(w, 0), _dim(w, 1)
        n = rows * cols
        nblocks = -(-n // block_size) if block_size > 0 else 0
        alloc = lambda count, dtype: torch.empty(count, dtype=dtype, device=w.device)  # noqa: E731
        out = types.SimpleNamespace(
            codes=alloc(-(-n // 2), torch.uint8), absmax=alloc(nblocks, torch.uint8 if double_quant else torch.float32),
            absmax2=alloc(-(-nblocks // NF4_NESTED_BLOCK_SIZE), torch.float32) if double_quant else None,
            code2=alloc(256, torch.float32) if double_quant else None, offset=0.0, shape=(rows, cols),
            block_size=block_size)
        offset = _call(_qmm.nf4_quantize, w, w, out)
        return cls(out.codes, out.absmax, (rows, cols), block_size, out.absmax2, out.code2, offset)

    def dequantize(self, dtype=torch.bfloat16):
        """W [rows, cols] = codebook[code] * scale, in float32 or bfloat16 (rounded to nearest even)."""
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        _call(_qmm.nf4_dequantize, out, self._native, out)
        return out

    def to(self, device):
        t = lambda x: None if x is None else x.to(device)  # noqa: E731
        return Nf4Weight(t(self.codes), t(self.absmax), self.shape, self.block_size, t(self.absmax2), t(self.code2),
                         self.offset)

    @classmethod
    def from_bnb(cls, data, quant_state):
        """Wraps a bitsandbytes 4-bit weight without copying: `data` is Params4bit's packed uint8 tensor and
        `quant_state` its QuantState (quant_type "nf4"; plain or nested scales)."""
        qs = quant_state
        data = _as_bytes(data)
        if qs.quant_type != "nf4":
            raise _error("Unsupported", f"Nf4Weight.from_bnb: quant_type '{qs.quant_type}' (qmm takes nf4)")
        if getattr(qs, "packing_format_for_cpu", False):  # bitsandbytes repacks for its CPU kernels at inference
            raise _error("Unsupported", "Nf4Weight.from_bnb: the weight is in bitsandbytes' CPU inference layout "
                                        "(packing_format_for_cpu), not bitsandbytes' NF4 layout")
        if getattr(qs, "state2", None) is None:
            return cls(data, qs.absmax, tuple(qs.shape), qs.blocksize)
        if qs.state2.blocksize != NF4_NESTED_BLOCK_SIZE:
            raise _error("Unsupported", f"Nf4Weight.from_bnb: nested block size {qs.state2.blocksize} "
                                        f"(qmm takes {NF4_NESTED_BLOCK_SIZE})")
        return cls(data, qs.absmax, tuple(qs.shape), qs.blocksize, qs.state2.absmax, qs.state2.code, float(qs.offset))

    @classmethod
    def from_bnb_state_dict(cls, state_dict, prefix="weight"):
        """The weight `prefix` of a bitsandbytes 4-bit checkpoint's state dict: `prefix` (packed codes),
        `prefix.absmax`, `prefix.quant_state.bitsandbytes__nf4` (JSON: shape, blocksize, nested_offset, ...), when
        double-quantized `prefix.nested_absmax` and `prefix.nested_quant_map`, optionally `prefix.quant_map`. Every
        field is checked against the others by qmm's checkpoint loader (the checks `qmm finetune` runs on a file):
        a missing or malformed one is a qmm.Error naming its key (code "Io"), a valid format qmm does not take (FP4,
        another block size or code map) "Unsupported". The tensors are taken as they are, not copied."""
        op = "Nf4Weight.from_bnb_state_dict"
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise _error("InvalidArgument", f"{op}: argument 'state_dict' must be a mapping of names to tensors, not "
                                            f"{type(state_dict).__name__}")
        if not isinstance(prefix, str):
            raise _error("InvalidArgument", f"{op}: argument 'prefix' must be a str, not {type(prefix).__name__}")
        fields = {k: state_dict[k] for k in state_dict.keys()
                  if isinstance(k, str) and (k == prefix or k.startswith(prefix + "."))}
        for k, v in fields.items():
            if not isinstance(v, torch.Tensor):
                raise _error("Io", f"{op}: '{k}' is a {type(v).__name__}, not a tensor")
        # The packed codes are bytes whatever dtype bitsandbytes stored them in (its quant_storage).
        meta = {k: ("U8", [v.numel() * v.element_size()]) if k == prefix else (_FILE_DTYPES.get(v.dtype, str(v.dtype)),
                                                                                list(v.shape))
                for k, v in fields.items()}

        def read(name):
            return fields[name].detach().reshape(-1).contiguous().cpu().view(torch.uint8)

        rows, cols, block_size, nested, offset = _qmm.check_bnb_nf4(meta, read, prefix, op)
        codes, absmax = _as_bytes(fields[prefix]), fields[f"{prefix}.absmax"]
        if not nested:
            return cls(codes, absmax, (rows, cols), block_size)
        return cls(codes, absmax, (rows, cols), block_size, fields[f"{prefix}.nested_absmax"],
                   fields[f"{prefix}.nested_quant_map"], offset)

    def to_bnb_state_dict(self, prefix="weight", dtype=torch.bfloat16):
        """The weight as a bitsandbytes 4-bit checkpoint stores it (the keys from_bnb_state_dict reads, plus
        `prefix.quant_map`); `dtype` is the layer's weight dtype that bitsandbytes records."""
        meta = {"quant_type": "nf4", "blocksize": self.block_size, "dtype": str(dtype).replace("torch.", ""),
                "shape": list(self.shape)}
        sd = {prefix: self.codes.reshape(-1, 1), f"{prefix}.absmax": self.absmax,
              f"{prefix}.quant_map": torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=self.device)}
        if self.double_quant:
            meta.update(nested_blocksize=NF4_NESTED_BLOCK_SIZE, nested_dtype="float32", nested_offset=self.offset)
            sd[f"{prefix}.nested_absmax"] = self.absmax2
            sd[f"{prefix}.nested_quant_map"] = self.code2
        sd[f"{prefix}.quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(meta).encode("utf-8")),
                                                                     dtype=torch.uint8)
        return sd



def _nf4(op, name, w):
    if not isinstance(w, Nf4Weight):
        raise _error("InvalidArgument", f"{op}: argument '{name}' must be a qmm.Nf4Weight, not {type(w).__name__}")
    return w.shape
