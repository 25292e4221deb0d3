"""``python -m nasd_core "prompt"``: generate once with NASD and print the text and the stats."""

from __future__ import annotations

import argparse
import json
import sys

from nasd_core.config import SamplingParams, SpecConfig, build
from nasd_core.errors import NASDError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nasd_core", description=__doc__)
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--speculation", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--draft-tokens", type=int, default=None, help="draft length gamma")
    parser.add_argument("--model", default=None, help="HF model id or dir (default: embedded SmolLM2-135M)")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)

    from nasd_core.generate import generate
    from nasd_core.loader import load_model

    try:
        params = build(
            SamplingParams,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
        )
        spec_fields = {"mode": args.speculation}
        if args.draft_tokens is not None:
            spec_fields["num_draft_tokens"] = args.draft_tokens
        spec = build(SpecConfig, **spec_fields)
        model, tokenizer = load_model(args.model)
        prompt = (
            args.prompt
            if args.raw
            else tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=False
            )
        )
        result = generate(model, tokenizer, prompt, params, spec)
    except NASDError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stats = result.stats
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "finish_reason": result.finish_reason,
                    "num_tokens": len(result.token_ids),
                    "stats": stats.to_dict(),
                }
            )
        )
        return 0
    print(result.text)
    tokens_per_s = len(result.token_ids) / stats.decode_time_s if stats.decode_time_s else 0.0
    print(
        f"\n[{len(result.token_ids)} tokens, {tokens_per_s:.1f} tok/s, {stats.num_steps} target forwards, "
        f"{stats.tokens_per_step:.2f} tokens/forward, acceptance {stats.acceptance_rate:.2f}, "
        f"drafting {100 * stats.drafting_share:.2f}% of decode time, finish: {result.finish_reason}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
