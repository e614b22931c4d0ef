"""`python -m bench.data`: the data path at scale: prepare throughput, and training
on a small against a large prepared corpus (per-rank peak memory, time to the first
step, data loading as a share of step time).

    python -m bench.data                         # 1 GB generated corpus, char and bpe
    python -m bench.data --size-mb 64 --small-mb 4 --steps 10 --rounds 1   # smoke test, ~1 min

Everything lives in a temporary directory that is deleted at the end (the corpus
is generated: `char_dataset.embedded_corpus` with a new seed per 4 MB block, split
over files of `--file-mb`; nothing is downloaded):

1. `python main.py mode=prepare` of the whole corpus, once per tokenizer of
   `--tokenizers`: `char`, and `bpe`: the gpt2 code path (tiktoken, GPT-2's
   pre-tokenizer) with a generated BPE in GPT-2's file format that spells the
   corpus's words (data.tokenizer.data_gym_files), since GPT-2's own files need a
   download (`gpt2` uses them if TIKTOKEN_CACHE_DIR holds them). Reported: wall
   time of the command, MB/s of text, tokens/s, peak RSS of the main process
   and of the largest worker.
2. The first `--small-mb` of the corpus prepared the same way (char).
3. `--rounds` rounds of 2-rank torchrun trainings (`--nproc`) of the default model
   for `--steps` steps on the small and on the large char corpus, alternating, plus
   the small corpus through the text path (data.path) for reference (the order
   rotates each round). Each rank
   reports its peak RSS; time to the first step is from the launch of torchrun to
   the end of step 1 (the main rank's clock; every rank ends step 1 together);
   data share = median data_ms / median step_ms over the steps after the first 2.

Results: --out's results.json (every round) and results.md, written by bench/report.py.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import report  # noqa: E402

TRAIN = ["trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=1", "sample.length=0",
         "wandb.mode=disabled", "parallel.dp=ddp_bucket"]


# ---------------------------------------------------------------- inside the jobs

def worker_prepare(overrides):
    """Runs main's prepare in this process; reports its peak RSS and its workers' (forked
    from it, so they start with its RSS: python, numpy and torch, which main imports)."""
    import main
    started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    main.main(overrides, 0, 1, 0)
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print("RESULT " + json.dumps({"rss_start_mb": started, "rss_main_mb": me,
                                  "rss_worker_mb": kids}), flush=True)


def worker_train(overrides):
    """One torchrun rank: main.main, then this rank's peak RSS (and, on rank 0, when
    step 1 was logged). Leaves as main.py does (launch/exit.py)."""
    import main
    from launch.exit import flush_and_exit
    from telemetry.metrics import MetricsLog
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    first, write = [], MetricsLog.write

    def noted(self, record, total, console):
        if not first:
            first.append(time.time())
        write(self, record, total, console)
    MetricsLog.write = noted
    main.main(overrides, rank, world, int(os.environ["LOCAL_RANK"]))
    out = {"rank": rank, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if first:
        out["first_step_s"] = first[0] - float(os.environ["BENCH_LAUNCHED"])
    with open(os.path.join(os.environ["BENCH_RESULTS"], f"rank-{rank}.json"), "w") as f:
        json.dump(out, f)  # a file each: ranks printing at once can share a line
    flush_and_exit(0)


# ---------------------------------------------------------------- the launcher

def generate(directory, size_mb, file_mb):
    """size_mb of generated play text in files of file_mb; returns the bytes written."""
    from char_dataset import embedded_corpus
    os.makedirs(directory)
    written, block, f, in_file = 0, 0, None, 0
    while written < size_mb * 2**20:
        if f is None or in_file >= file_mb * 2**20:
            if f:
                f.close()
            f, in_file = open(os.path.join(directory, f"part-{written // 2**20:06d}.txt"), "w"), 0
        want = min(4 * 2**20, int(size_mb * 2**20) - written)
        text = embedded_corpus(want, seed=block)[:want]  # it ends at a line's end past `want`
        f.write(text)
        written, in_file, block = written + len(text), in_file + len(text), block + 1
    f.close()
    return written


def corpus_bpe(directory):
    """A TIKTOKEN_CACHE_DIR with a BPE in GPT-2's format whose merges spell every word of
    the generated corpus, with and without a leading space."""
    import re
    from char_dataset import embedded_corpus
    from data.tokenizer import cache_gpt2_files, data_gym_files
    words = sorted(set(re.findall(r"[A-Za-z]+", embedded_corpus(200_000))))
    return cache_gpt2_files(directory, data_gym_files(words + [" " + w for w in words]))


def run(cmd, env, what, timeout=7200, expect_result=True):
    started = time.time()
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    results = [json.loads(ln[7:]) for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or (expect_result and not results):
        raise SystemExit(f"{what} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return time.time() - started, results, out.stdout


def prepare(src, dst, tokenizer, workers, env):
    args = ["mode=prepare", f"data.path={src}", f"data.tokens_path={dst}", f"prepare.workers={workers}",
            f"data.tokenizer={'char' if tokenizer == 'char' else 'gpt2'}"]
    seconds, (result,), stdout = run([sys.executable, "-m", "bench.data", "--worker-prepare", *args],
                                     env, f"prepare {tokenizer}")
    with open(os.path.join(dst, "index.json")) as f:
        index = json.load(f)
    mb = sum(source[1] for source in index["request"]["sources"]) / 2**20  # [url, size, version]
    return {"tokenizer": tokenizer, "text_mb": mb, "tokens": index["tokens"], "seconds": seconds,
            "mb_per_s": mb / seconds, "tokens_per_s": index["tokens"] / seconds,
            "shards": len(index["shards"]), "dtype": index["dtype"], **result}


def train(name, data_arg, tmp, args, env):
    run_dir = os.path.join(tmp, f"run-{name}")
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = TRAIN + [data_arg, f"trainer.max_steps={args.steps}", f"trainer.run_dir={run_dir}",
                         *args.set]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "bench.data", "--worker-train", *overrides]
    results_dir = os.path.join(tmp, f"results-{name.replace(' ', '_')}")
    shutil.rmtree(results_dir, ignore_errors=True)
    os.makedirs(results_dir)
    env = dict(env, BENCH_LAUNCHED=repr(time.time()), BENCH_RESULTS=results_dir)
    run(cmd, env, f"training on {name}", expect_result=False)
    results = []
    for rank in range(args.nproc):
        with open(os.path.join(results_dir, f"rank-{rank}.json")) as f:
            results.append(json.load(f))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f][2:]
    step_ms = statistics.median(r["step_ms"] for r in steps)
    data_ms = statistics.median(r["data_ms"] for r in steps)
    return {"corpus": name, "first_step_s": next(r["first_step_s"] for r in results if "first_step_s" in r),
            "rss_mb": [r["rss_mb"] for r in sorted(results, key=lambda r: r["rank"])],
            "step_ms": step_ms, "data_ms": data_ms, "data_share": data_ms / step_ms}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.split("\n")[0])
    p.add_argument("--worker-prepare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-train", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size-mb", type=int, default=1024, help="generated corpus (MB of text)")
    p.add_argument("--small-mb", type=int, default=10, help="the small corpus: this prefix of it")
    p.add_argument("--file-mb", type=int, default=128, help="size of each generated file")
    p.add_argument("--tokenizers", default="char,bpe", help="prepare throughput for: char, bpe, gpt2")
    p.add_argument("--workers", type=int, default=0, help="prepare.workers (0: one per core)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--set", action="append", default=[], help="extra key=value for the trainings")
    p.add_argument("--out", default="runs/bench/data")
    args, overrides = p.parse_known_args(argv)
    if args.worker_prepare:
        return worker_prepare(overrides)
    if args.worker_train:
        return worker_train(overrides)

    command, load_before = report.command_line("-m bench.data", argv), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, WANDB_SILENT="true")
        started = time.time()
        size = generate(os.path.join(tmp, "big"), args.size_mb, args.file_mb)
        small = os.path.join(tmp, "small")
        generate(small, args.small_mb, args.small_mb)
        print(f"generated {size / 2**20:.0f} MB in {time.time() - started:.0f} s", flush=True)
        prepared = []
        for tok in args.tokenizers.split(","):
            tok_env = dict(env, TIKTOKEN_CACHE_DIR=corpus_bpe(os.path.join(tmp, "tiktoken"))) \
                if tok == "bpe" else env
            prepared.append(prepare(os.path.join(tmp, "big"), os.path.join(tmp, f"tokens-{tok}"),
                                    tok, args.workers, tok_env))
            r = prepared[-1]
            print(f"prepare {tok}: {r['text_mb']:.0f} MB in {r['seconds']:.1f} s: {r['mb_per_s']:.1f} MB/s, "
                  f"{r['tokens_per_s'] / 1e6:.2f}M tokens/s; peak RSS main {r['rss_main_mb']:.0f} MB "
                  f"(at start {r['rss_start_mb']:.0f}), worker {r['rss_worker_mb']:.0f} MB", flush=True)
            if tok != "char":
                shutil.rmtree(os.path.join(tmp, f"tokens-{tok}"))  # disk: only char's is trained on
        prepare(small, os.path.join(tmp, "tokens-small"), "char", args.workers, env)
        variants = {f"{args.small_mb} MB tokens": f"data.tokens_path={os.path.join(tmp, 'tokens-small')}",
                    f"{args.size_mb} MB tokens": f"data.tokens_path={os.path.join(tmp, 'tokens-char')}",
                    f"{args.small_mb} MB text path": f"data.path={os.path.join(small, os.listdir(small)[0])}"}
        rounds = []
        names = list(variants)
        for i in range(args.rounds):  # rotated each round: no variant always runs first
            for name in names[i % len(names):] + names[:i % len(names)]:
                data_arg = variants[name]
                r = train(name, data_arg, tmp, args, env)
                rounds.append({"round": i, **r})
                print(f"round {i} {name}: first step {r['first_step_s']:.2f} s, RSS per rank "
                      f"{[round(m) for m in r['rss_mb']]} MB, step {r['step_ms']:.1f} ms, data "
                      f"{r['data_ms']:.2f} ms ({100 * r['data_share']:.1f}%)", flush=True)
    write_report(args, command, load_before, prepared, rounds, list(variants))


def prepare_table(prepared):
    """results.md's mode=prepare table: a row per tokenizer (results.json's "prepare")."""
    rows = [[r["tokenizer"], f"{r['text_mb']:.0f}", f"{r['tokens']:,}", f"{r['shards']} ({r['dtype']})",
             f"{r['seconds']:.1f}", f"{r['mb_per_s']:.1f}", f"{r['tokens_per_s'] / 1e6:.2f}M",
             f"{r['rss_start_mb']:.0f} / {r['rss_main_mb']:.0f} / {r['rss_worker_mb']:.0f}"]
            for r in prepared]
    return report.table(["tokenizer", "text MB", "tokens", "shards (dtype)", "wall s", "MB/s of text",
                         "tokens/s", "peak RSS MB: main at start / main / largest worker"], rows)


def train_medians(rounds, names):
    """Per corpus, the median over rounds of each figure of results.json's "train" (of
    peak RSS: the largest rank's)."""
    return {n: {k: statistics.median(r[k] if k != "rss_mb" else max(r[k]) for r in rounds if r["corpus"] == n)
                for k in ("first_step_s", "rss_mb", "step_ms", "data_ms", "data_share")} for n in names}


def train_table(med):
    rows = [[n, f"{m['first_step_s']:.2f}", f"{m['rss_mb']:.0f}", f"{m['step_ms']:.1f}",
             f"{m['data_ms']:.2f}", f"{100 * m['data_share']:.1f}%"] for n, m in med.items()]
    return report.table(["data", "time to first step s", "peak RSS, largest rank MB", "step ms",
                         "data ms", "data share"], rows)


def write_report(args, command, load_before, prepared, rounds, names):
    env = report.environment(load_before)
    med = train_medians(rounds, names)
    small, big = names[0], names[1]
    lines = [*report.header("Data path at scale", command,
                            [f"{args.nproc} ranks x 1 thread, gloo; generated corpus"], env),
             "", "## mode=prepare", "", *prepare_table(prepared),
             "", f"## Training, default model, {args.steps} steps (median of {args.rounds} rounds)", "",
             *train_table(med),
             "", f"Large vs small prepared corpus: time to first step "
             f"{med[big]['first_step_s'] / med[small]['first_step_s']:.2f}x, peak RSS "
             f"{med[big]['rss_mb'] / med[small]['rss_mb']:.2f}x (target: within 10%).", "",
             "Notes: `bpe` is the gpt2 code path (tiktoken, GPT-2's pre-tokenizer) with a "
             "generated BPE that spells the corpus's words, far fewer merges than GPT-2's 50,000 "
             "(whose files need a download). MB/s and tokens/s are over the whole command "
             "(start-up, and for char the vocabulary pass, included). A prepare worker is forked "
             "after main.py imported torch, so its RSS includes the ~300 MB it shares with its "
             "parent. Time to first step runs from launching torchrun to the end of step 1. "
             "Training reads step s+1's windows at the end of step s (memory-mapped shards, the "
             "pages let go of after each read); data ms is that read, counted in step ms.", ""]
    doc = {"command": command, "environment": env, "prepare": prepared, "train": rounds,
           "load_avg_1min": os.getloadavg()[0]}  # the key results before "environment" had
    report.write_results(args.out, doc, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
