"""What the request features cost a decode step: batch-256 engine steps with no request using them, and with every
request using penalties and logprobs, in one run (ratios of times measured on one machine, one engine).

    python3 benchmarks/request_features.py                    # default model (Qwen3-0.6B shape on a GPU)
    python3 benchmarks/request_features.py --batch 64 --rounds 3 --top-logprobs 20

Each round times every case once, in turn (plain greedy, plain sampled, logprobs, penalties, both, plain sampled
again: a drift of the machine shows), and the table reports each case's median over the rounds. Penalties:
repetition 1.1, frequency 0.2 and presence 0.3, a 4-entry logit_bias; logprobs with the top-N (`--top-logprobs`);
all at temperature 0.8 (compare with plain sampled). Target (issue 28): penalties + logprobs at most 10 % slower.
"""
import argparse
import statistics

from decode_step import engine_step_time
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top-logprobs", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", nargs="+", default=None,
                        help="only these cases (by name, e.g. 'penalties+logprobs')")
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_running=args.batch,
                                    max_model_len=max(2 * args.context, 1024)))
    penalties = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.3,
                     logit_bias={11: 1.0, 13: -1.0, 220: 0.5, 1000: -2.0})
    cases = {
        "plain greedy": lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
        "plain sampled": lambda n: SamplingParams(max_tokens=n, temperature=0.8, seed=1, ignore_eos=True),
        "logprobs only": lambda n: SamplingParams(max_tokens=n, temperature=0.8, seed=1, ignore_eos=True,
                                                  logprobs=args.top_logprobs),
        "penalties only": lambda n: SamplingParams(max_tokens=n, temperature=0.8, seed=1, ignore_eos=True,
                                                   **penalties),
        "penalties+logprobs": lambda n: SamplingParams(max_tokens=n, temperature=0.8, seed=1, ignore_eos=True,
                                                       logprobs=args.top_logprobs, **penalties),
        "plain sampled again": lambda n: SamplingParams(max_tokens=n, temperature=0.8, seed=1, ignore_eos=True),
    }
    if args.cases:
        cases = {name: cases[name] for name in args.cases}
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, params in cases.items():
            times[name].append(engine_step_time(engine, args.batch, args.context, args.iters, params))
    base = statistics.median(times.get("plain sampled") or next(iter(times.values())))
    print(f"\nbatch {args.batch}, context {args.context}, {args.iters} steps x {args.rounds} rounds, "
          f"top logprobs {args.top_logprobs}")
    print(f"{'case':<20} {'ms/step':>8} {'vs plain sampled':>17}  rounds (ms)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<20} {median * 1e3:>8.3f} {median / base - 1:>+16.1%}  "
              + " ".join(f"{v * 1e3:.3f}" for v in values))


if __name__ == "__main__":
    main()
