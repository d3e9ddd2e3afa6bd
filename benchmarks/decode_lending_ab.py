"""What a decode step lent a larger captured graph costs (cuda_graphs.LEND_LARGER_DECODE_STEPS): a held
Engine on random weights runs a call of `--wide` rows (its decode graphs captured), then calls of
`--rows` rows: lent the wide call's decode graphs (no capture), then with the lending off (the first
such call captures graphs of its own; the next is timed on them). Prints the timed calls and the
captures of each, in one process.

    PYTHONPATH=. python benchmarks/decode_lending_ab.py [--shape llama3.2-1b] [--wide 64] [--rows 7]
                                                       [--prompt 128] [--new 256]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.engine import cuda_graphs
from hf_async_cb.tools.bench import _prompts, build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--wide", type=int, default=64)
    parser.add_argument("--rows", type=int, default=7)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per setting (the best is reported)")
    parser.add_argument("--device", default="cuda", help="cpu: the graphs' eager stand-in (checks the script only)")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = build_model(args.shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    engine = Engine(model, BatchingConfig(mode="async", cuda_graphs=True, prefix_caching=False))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    vocab = model.config.vocab_size
    engine.generate(_prompts(args.wide, args.prompt, vocab), max_new_tokens=args.new, eos_token_ids=())
    prompts = _prompts(args.rows, args.prompt, vocab)

    def timed() -> tuple[float, int]:
        before = engine.graphs.num_captured
        sync()
        started = time.perf_counter()
        engine.generate(prompts, max_new_tokens=args.new, eos_token_ids=())
        sync()
        return time.perf_counter() - started, engine.graphs.num_captured - before

    results = {}
    for setting in ("lent", "own"):
        if setting == "own":
            cuda_graphs.LEND_LARGER_DECODE_STEPS = 0
        first = timed()
        runs = [timed() for _ in range(args.repeat)]
        results[setting] = dict(first_s=round(first[0], 4), first_captures=first[1],
                                best_s=round(min(s for s, _ in runs), 4), later_captures=sum(c for _, c in runs))
        print(f"{setting}: first call {first[0]:.3f} s ({first[1]} captures), best of {args.repeat} later "
              f"{results[setting]['best_s']:.3f} s ({results[setting]['later_captures']} captures)")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(json.dumps(dict(vars(args), gpu=name, **results)))


if __name__ == "__main__":
    main()
