"""`python -m bench.sampling`: mode=sample's time per token, with the sampler's key/value
cache (generation/kv_cache.py) and without (the model's own GPT.generate).

    python -m bench.sampling                               # the default model, 127 and 500 tokens
    python -m bench.sampling --rounds 5 --out docs/bench/sampling

One process samples N tokens from the default model (gpt2_train_cfg.yaml's shape, the
embedded corpus's character vocabulary, `sample:`'s prompt, temperature and top_k;
`--set key=value` changes any of them) both ways from the same seed, checks that both
drew the same tokens, and reports the median wall-clock and CPU time of each and their
ratio (taken within each round, then the median over rounds). The weights are a seeded
initialization: the time per token does not depend on their values. N below block_size
is the cache's whole gain; past it each token recomputes the context's window either way
(the positions moved: kv_cache.py), so a long sample's ratio falls towards 1.
"""

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import report  # noqa: E402

CASES = ("uncached", "cached")


def build(sets):
    """(model, prompt ids (1, T), the sample config) of the configured model."""
    import torch
    from dataclasses import asdict
    from char_dataset import build_tokenizer, embedded_corpus
    from config import load_config
    from model import GPT, GPTConfig
    cfg = load_config(list(sets), 1)
    tokenizer = build_tokenizer("char", text=embedded_corpus())
    shape = {k: v for k, v in asdict(cfg.model).items() if k != "init_from"}
    model = GPT(GPTConfig(**shape, vocab_size=tokenizer.vocab_size,
                          block_size=cfg.data.block_size), seed=0).eval()
    prompt = torch.tensor([tokenizer.encode(cfg.sample.prompt) or [0]], dtype=torch.long)
    return model, prompt, cfg.sample


def sample(case, model, prompt, n, scfg):
    """(tokens, wall s, CPU s) of sampling n tokens one way."""
    import torch
    from generation import kv_cache
    gen = torch.Generator().manual_seed(scfg.seed)
    args = dict(temperature=scfg.temperature, top_k=scfg.top_k or None, generator=gen)
    started, cpu = time.perf_counter(), time.process_time()
    if case == "cached":
        out = kv_cache.generate(model, prompt, n, **args)
    else:
        out = model.generate(prompt, n, **args)
    return out, time.perf_counter() - started, time.process_time() - cpu


def measure(args):
    """{str(n): {case: [[wall s, CPU s] per round]}}; raises if the two ways' tokens differ."""
    import torch
    torch.set_num_threads(args.threads)
    model, prompt, scfg = build(args.set)
    times = {str(n): {case: [] for case in CASES} for n in args.tokens}
    for i in range(args.rounds):
        for n in args.tokens:
            drawn = {}
            for case in (CASES if i % 2 == 0 else CASES[::-1]):  # alternated: neither always first
                drawn[case], wall, cpu = sample(case, model, prompt, n, scfg)
                times[str(n)][case].append([wall, cpu])
            if not torch.equal(drawn["cached"], drawn["uncached"]):
                raise SystemExit(f"{n} tokens: the cached sampler drew other tokens than the uncached one")
            print(f"round {i}, {n} tokens: " + ", ".join(
                f"{c} {times[str(n)][c][-1][0]:.2f} s" for c in CASES), flush=True)
    return times, model.config.block_size, model.num_params()


def rows(times):
    """The table's rows from results.json's `seconds`."""
    out = []
    for n, by_case in times.items():
        for clock, k in (("wall", 0), ("CPU", 1)):
            plain = statistics.median(t[k] for t in by_case["uncached"])
            cached = statistics.median(t[k] for t in by_case["cached"])
            ratio = statistics.median(u[k] / c[k] for u, c in zip(by_case["uncached"], by_case["cached"]))
            out.append([n, clock, f"{plain:.2f}", f"{cached:.2f}", f"{1e3 * plain / int(n):.1f}",
                        f"{1e3 * cached / int(n):.1f}", f"{ratio:.1f}x"])
    return out


def table(times):
    return report.table(["tokens", "clock", "uncached s", "cached s", "uncached ms/token",
                         "cached ms/token", "speed-up (median of rounds)"], rows(times), "llrrrrr")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[127, 500],
                   help="comma-separated sample lengths (default 127,500)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override (model.*, data.block_size, sample.*), repeatable")
    p.add_argument("--out", default=os.path.join("runs", "bench", "sampling"),
                   help="a folder for results.json and results.md (default runs/bench/sampling)")
    args = p.parse_args(argv)
    command, load_before = report.command_line("-m bench.sampling", argv), os.getloadavg()
    times, block_size, params = measure(args)
    env = report.environment(load_before)
    text = "\n".join(report.header("Sampling with and without the key/value cache", command, [
        "gpt2_train_cfg.yaml's model" + (" with " + " ".join(args.set) if args.set else "")
        + f" ({params / 1e6:.2f}M parameters, block_size {block_size}), one process, {args.threads} "
        f"thread(s), {args.rounds} rounds; the same tokens drawn both ways (checked)"], env)
        + ["", *table(times), ""])
    if args.out:
        report.write_results(args.out, {"command": command, "environment": env, "settings": vars(args),
                                        "block_size": block_size, "parameters": params,
                                        "seconds": times}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
