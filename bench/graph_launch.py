#!/usr/bin/env python3
"""How long the GPU waits for a replayed CUDA graph to start: graphs of N small kernels (with and without memset
nodes among them), replayed the way qmm.graph_step replays a training step (a host-launched copy of the input into
the captured buffer, then graph.replay()), with and without the graph uploaded ahead (cudaGraphUpload). Per case:
the host time of replay() and, from torch.profiler over back-to-back replays, the GPU's idle time between the copy
and the graph's first kernel and the graph's span. "own exec" instantiates the captured graph itself without flags
(PyTorch instantiates with AutoFreeOnLaunch and UseNodePriority) and launches it with cudaGraphLaunch.

    python3 bench/graph_launch.py [--nodes 400,2000] [--json out/graph_launch.json]
"""
import argparse
import ctypes
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import train_step  # write_report


def cudart():
    """A CUDA runtime library (PyTorch's own where it is already loaded under that name), or None."""
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def capture(n, memsets, stream, rt, keep=False):
    """A graph of n x.add_(1) kernels, every 20th preceded by a memset node where `memsets`."""
    x = torch.zeros(1 << 14, device="cuda")
    scratch = torch.empty(1 << 16, dtype=torch.uint8, device="cuda")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=keep)
    with torch.cuda.graph(g, stream=stream):
        for i in range(n):
            if memsets and i % 20 == 0:
                rt.cudaMemsetAsync(ctypes.c_void_p(scratch.data_ptr()), 0, ctypes.c_size_t(scratch.numel()),
                                   ctypes.c_void_p(stream.cuda_stream))
            x.add_(1)
    torch.cuda.synchronize()
    return g, (x, scratch)


class OwnExec:
    """The captured graph instantiated here without flags, launched with cudaGraphLaunch."""

    def __init__(self, g, rt):
        self.rt, self.exec = rt, ctypes.c_void_p()
        rc = rt.cudaGraphInstantiateWithFlags(ctypes.byref(self.exec), ctypes.c_void_p(g.raw_cuda_graph()),
                                              ctypes.c_ulonglong(0))
        if rc != 0:
            raise RuntimeError(f"cudaGraphInstantiateWithFlags returned {rc}")

    def replay(self):
        self.rt.cudaGraphLaunch(self.exec, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))

    def raw_cuda_graph_exec(self):
        return self.exec.value


def measure(g, upload, rt):
    inp = torch.zeros(4096, dtype=torch.long, device="cuda")
    static = inp.clone()
    if upload:
        rc = rt.cudaGraphUpload(ctypes.c_void_p(g.raw_cuda_graph_exec()),
                                ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if rc != 0:
            return {"error": f"cudaGraphUpload returned {rc}"}
    for _ in range(3):
        static.copy_(inp)
        g.replay()
    torch.cuda.synchronize()
    host = []
    for _ in range(10):
        torch.cuda.synchronize()
        static.copy_(inp)
        t0 = time.perf_counter()
        g.replay()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            static.copy_(inp)
            g.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if str(e.device_type).endswith("CUDA")), key=lambda e: e.time_range.start)
    waits = [b.time_range.start - a.time_range.end for a, b in zip(events, events[1:]) if "Memcpy" in a.name]
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(events, events[1:])]
    return {"replay_host_us": statistics.median(host), "wait_after_copy_us": [round(w, 1) for w in waits],
            "idle_us": round(sum(x for x in gaps if x > 0) / 3, 1),
            "span_us": round((events[-1].time_range.end - events[0].time_range.start) / 3, 1),
            "first_kernels": [e.name[:40] for e in events[:3]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="400,2000")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.exit(1, "graph_launch: needs a CUDA GPU\n")
    rt = cudart()
    side = torch.cuda.Stream()
    results = []
    for n in (int(v) for v in args.nodes.split(",")):
        for memsets in (False, True):
            if memsets and rt is None:
                continue
            for upload in (False, True):
                if upload and rt is None:
                    continue
                g, keep = capture(n, memsets, side, rt)
                r = {"nodes": n, "memsets": memsets, "uploaded": upload, **measure(g, upload, rt)}
                print(r, flush=True)
                results.append(r)
                del g, keep
            if rt is not None:
                g, keep = capture(n, memsets, side, rt, keep=True)
                try:
                    own = OwnExec(g, rt)
                    r = {"nodes": n, "memsets": memsets, "own exec": True, **measure(own, False, rt)}
                    torch.cuda.synchronize()
                    rt.cudaGraphExecDestroy(own.exec)
                except RuntimeError as e:
                    r = {"nodes": n, "memsets": memsets, "own exec": True, "error": str(e)}
                print(r, flush=True)
                results.append(r)
                del g, keep
    train_step.write_report({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                             "results": results}, args.json)


if __name__ == "__main__":
    main()
