"""Where a run's execute goes, step by step: `lmbatch run` with every decode step, prefill batch, first-token
round, decode-graph capture and `Engine.stream` call (a wave) timed on the host, written to a JSON file, then
summarized per wave (steps, rows, prefill, the gaps between waves).

    python benchmarks/step_log.py OUT.json [--prof 900:1000] -- run tot-gsm8k --model DIR
    python benchmarks/step_log.py OUT.json --show          # its summary

`--prof a:b` also profiles the device (torch profiler, CUDA kernels) from decode step a to b: its busy time and
the kernels' totals. Timings are the host's: a step's time includes its wait for the device.
"""
import argparse
import atexit
import json
import sys
import time

T0 = time.perf_counter()
LOG: dict = {"steps": [], "prefill": [], "streams": [], "load": [], "first": []}
PROF = None
PATH = None


def _now():
    return time.perf_counter() - T0


HOST = {  # the host work of a decode step, timed per call: name -> (module, class, method)
    "level_plan": ("lmbatch.engine.graphs", "DecodeGraphs", "_level_plan"),
    "runner_decode": ("lmbatch.engine.model_runner", "ModelRunner", "decode"),
    "land": ("lmbatch.engine.sampler", "Sampler", "land"),
    "stop_search": ("lmbatch.engine.sampler", "Sampler", "_stop_in_tail"),
    "launch": ("lmbatch.engine.sampler", "Sampler", "launch"),
    "release": ("lmbatch.engine.decode", "Decode", "_release_finished"),
    "event_wait": ("torch.cuda", "Event", "synchronize"),
}


def _time_host():
    """LOG["host"][name] = [calls, seconds] for each of HOST (nested ones counted in both)."""
    import importlib

    LOG["host"] = {}
    for name, (mod, cls, meth) in HOST.items():
        owner = getattr(importlib.import_module(mod), cls)
        f0, rec = getattr(owner, meth), LOG["host"].setdefault(name, [0, 0.0])

        def timed(*a, _f=f0, _r=rec, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                _r[0] += 1
                _r[1] += time.perf_counter() - t
        setattr(owner, meth, timed)


def _patch():
    from lmbatch.engine import decode as dmod
    from lmbatch.engine import engine as emod
    from lmbatch.engine import graphs as gmod
    from lmbatch.engine import model_runner as mmod
    from lmbatch.run import loading

    step0 = dmod.Decode.step
    prof = {"p": None, "n": 0}
    _time_host()

    def step(self):
        n = len(self.running)
        prof["n"] += 1
        if PROF:
            a, b = map(int, PROF.split(":"))
            if prof["n"] == a:
                import torch
                prof["p"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                prof["p"].__enter__()
                prof["t"] = _now()
            if prof["n"] == b and prof["p"] is not None:
                import torch
                torch.cuda.synchronize()
                p = prof["p"]
                p.__exit__(None, None, None)
                wall = _now() - prof["t"]
                ev = [(e.time_range.start, e.time_range.end, e.name) for e in p.events()
                      if e.device_type.name == "CUDA"]
                ev.sort()
                busy, end, tot = 0.0, None, {}
                for s, e, name in ev:
                    tot[name] = tot.get(name, 0) + (e - s)
                    if end is None or s > end:
                        busy += e - s
                        end = e
                    elif e > end:
                        busy += e - end
                        end = e
                LOG["prof"] = {"steps": b - a, "wall_s": wall, "busy_us": busy, "kernels": len(ev),
                               "span_us": (ev[-1][1] - ev[0][0]) if ev else 0,
                               "top": sorted(tot.items(), key=lambda x: -x[1])[:25]}
                prof["p"] = None
        t = _now()
        done = step0(self)
        LOG["steps"].append((round(t, 5), round(_now() - t, 5), n, done))
        return done
    dmod.Decode.step = step

    first0 = dmod.Decode._first_tokens

    def first(self):
        t = _now()
        first0(self)
        d = _now() - t
        if d > 0.0005:
            LOG["first"].append((round(t, 4), round(d, 5)))
    dmod.Decode._first_tokens = first

    fwd0 = mmod.ModelRunner.forward

    def fwd(self, batch):
        t = _now()
        out = fwd0(self, batch)
        LOG["prefill"].append((round(t, 5), round(_now() - t, 5), batch.num_tokens))
        return out
    mmod.ModelRunner.forward = fwd

    s0 = emod.Engine._stream

    def stream(self, requests, args):
        t = _now()
        LOG["streams"].append([round(t, 4), None, len(requests), self.options.max_running, self.pool.num_slots])
        rec = LOG["streams"][-1]
        for h in s0(self, requests, args):
            yield h
        rec[1] = round(_now() - t, 4)
        _dump()
    emod.Engine._stream = stream

    cap0 = gmod.DecodeGraphs._capture

    def cap(self, b, cascade):
        t = _now()
        cap0(self, b, cascade)
        LOG["load"].append(("capture", b, cascade, round(t, 4), round(_now() - t, 4)))
    gmod.DecodeGraphs._capture = cap

    build0 = loading.ModelLoader._build

    def build(self):
        t = _now()
        out = build0(self)
        LOG["load"].append(("build", round(t, 4), round(_now() - t, 4)))
        return out
    loading.ModelLoader._build = build


def _dump():
    if PATH:
        with open(PATH, "w") as f:
            json.dump(LOG, f)


def show(path):
    d = json.load(open(path))
    st, pf, sm = d["steps"], d["prefill"], d["streams"]
    caps = [x for x in d["load"] if x[0] == "capture"]
    print("load:", [x for x in d["load"] if x[0] == "build"], "captures:", len(caps),
          "capture s:", round(sum(x[4] for x in caps), 2))
    if caps:
        print("  first capture at", caps[0][3], "last end", round(caps[-1][3] + caps[-1][4], 2),
              "slowest:", sorted(caps, key=lambda x: -x[4])[:5])
    prev_end = None
    tot = {"steps": 0, "step_s": 0, "pf_s": 0, "pf_tok": 0}
    for i, (t, dur, n, maxr, slots) in enumerate(sm):
        end = t + (dur or 0)
        ss = [s for s in st if t <= s[0] < end]
        ps = [p for p in pf if t <= p[0] < end]
        rows = [s[2] for s in ss]
        step_s = sum(s[1] for s in ss)
        pf_s = sum(p[1] for p in ps)
        pf_tok = sum(p[2] for p in ps)
        small = sum(1 for r in rows if r < 256)
        small_s = sum(s[1] for s in ss if s[2] < 256)
        gap = round(t - prev_end, 3) if prev_end is not None else None
        print(f"wave {i}: start {t:.2f} dur {dur} gap-before {gap} reqs {n} | steps {len(ss)} in {step_s:.2f}s "
              f"mean rows {sum(rows) / max(1, len(rows)):.0f} max {max(rows, default=0)} "
              f"| <256 rows: {small} steps {small_s:.2f}s "
              f"| prefill {len(ps)} fwd {pf_tok} tok {pf_s:.2f}s")
        prev_end = end
        for k, v in (("steps", len(ss)), ("step_s", step_s), ("pf_s", pf_s), ("pf_tok", pf_tok)):
            tot[k] += v
    print(tot, "first-token calls", len(d["first"]), round(sum(x[1] for x in d["first"]), 2))
    if d["steps"]:
        import collections
        h = collections.Counter(min(s[2] // 64 * 64, 512) for s in st)
        hs = collections.defaultdict(float)
        for s in st:
            hs[min(s[2] // 64 * 64, 512)] += s[1]
        print("rows hist (bucket: steps, s):", {k: (h[k], round(hs[k], 2)) for k in sorted(h)})
    if "host" in d:
        print("host (calls, s):", {k: (c, round(t, 3)) for k, (c, t) in d["host"].items()})
    if "prof" in d:
        p = d["prof"]
        print("prof:", {k: p[k] for k in p if k != "top"})
        for name, us in p["top"]:
            print(f"   {us/1e3:9.1f} ms  {name[:100]}")


def main():
    global PROF, PATH
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--show", action="store_true", help="summarize OUT only")
    ap.add_argument("--prof", default=None, help="a:b, decode steps to profile on the device")
    ap.add_argument("args", nargs="*", help="lmbatch's command line")
    a = ap.parse_args()
    if not a.show:
        PROF, PATH = a.prof, a.out
        _patch()
        atexit.register(_dump)
        from lmbatch.cli import main as cli
        sys.argv = ["lmbatch", *a.args]
        cli()       # ends the process (os._exit); the log is written after every wave
        return
    show(a.out)


if __name__ == "__main__":
    main()
