"""Regenerate assistant replies with the target (self-distillation data), optionally drafted by a drafter.

Without --drafter this is `python -m training.regenerate`: the same arguments, the same output. With --drafter every
left-padded batch of replies is produced by batched tree speculative decoding (`tree_search.generate` on the batch)
instead of transformers' `generate`, so the distillation data for the next drafter is produced with the current one.
Verification is lossless by default: at --temperature 0 the replies are token-identical to the plain ones; above 0
they follow the same law (the temperature with the target's generation_config top-k / top-p, as `model.generate`
samples), reproducibly for a given --seed (reply n of the run draws from its own generator, seeded --seed + n).
--tree picks the tree policy in `generate`'s grammar: 'bandit' (the default: UCB over the paper's tree shapes, its
statistics kept across batches; bandit:A/B/... over others), a fixed shape such as 3,2,2,1,1, or 'none' (no drafting:
plain decoding on the same harness).
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import training.regenerate as plain
from mamba_draft.checkpoint import DRAFTER_HELP
from mamba_draft.devices import check_device, resolve_dtype
from tree_search.policy import GRAMMAR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    plain.add_arguments(parser)
    parser.add_argument("--drafter", help=DRAFTER_HELP + "; without it, plain batched target decoding")
    parser.add_argument("--tree", metavar="SPEC", help=f"with --drafter, the tree policy: {GRAMMAR} (default: bandit, "
                        "kept across batches)")
    parser.add_argument("--verifier", help="with --drafter: verifier name (default: greedy at temperature 0, else "
                        "sampling; both lossless)")


class DraftedGenerate:
    """`training.regenerate.Generate` by batched tree speculative decoding; sums the batches' stats. `load(embedding)`
    gives the drafter, called with the target's input embedding at the first batch (a drafter shipped without its
    own embedding reads the target's)."""

    def __init__(self, load, tree, verifier: str | None = None) -> None:
        self.load, self.tree, self.verifier = load, tree, verifier
        self.decoder = None  # built at the first batch, on the target it is handed
        self.totals = Counter()  # the batches' stats, summed

    def __call__(self, model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                 eos_token_ids: list[int], seed: int | None = None) -> list[list[int]]:
        from tree_search import SpeculativeDecoder

        if self.decoder is None:
            drafter = self.load(model.get_input_embeddings().weight)
            self.decoder = SpeculativeDecoder(model, drafter, tree=self.tree, verifier=self.verifier,
                                              tokenizer=tokenizer)
        # top_p / top_k None: the target's generation_config, as model.generate(do_sample=True, temperature=T)
        result = self.decoder.generate([list(p) for p in prompts], max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_p=None, top_k=None,
                                       eos_token_id=list(eos_token_ids), seed=seed)
        stats = result.stats
        self.totals.update(batches=1, new_tokens=stats.new_tokens, drafter_calls=stats.drafter_calls,
                           rounds=stats.rounds, accepted=sum(stats.accepted_lengths),
                           row_rounds=len(stats.accepted_lengths), seconds=stats.total_time)
        return result.new_tokens

    def summary(self) -> str:
        t = self.totals
        tau = t["accepted"] / t["row_rounds"] if t["row_rounds"] else 0.0  # tokens committed per row per round
        rate = t["new_tokens"] / t["seconds"] if t["seconds"] > 0 else 0.0
        return (f"drafted: {t['new_tokens']} new tokens in {t['batches']} batches, {t['rounds']} rounds, "
                f"tau {tau:.2f}, {rate:.1f} tok/s, drafter calls {t['drafter_calls']}")


def run(args: argparse.Namespace) -> int:
    from mamba_draft import load_drafter
    from tree_search.plan import plan_call
    from tree_search.policy import parse_policy
    from tree_search.sampling import resolve_sampling

    plain.check_arguments(args)
    given = [flag for flag in ("tree", "verifier") if getattr(args, flag) is not None]
    if given and not args.drafter:
        raise ValueError(" and ".join(f"--{flag}" for flag in given) + (" need" if len(given) > 1 else " needs")
                         + " --drafter")
    generate = None
    if args.drafter:
        check_device(args.device)
        path = Path(args.drafter).expanduser()
        if (args.drafter.startswith((".", "/", "~")) or path.exists()) and not path.is_dir():
            problem = "is not a directory" if path.exists() else "does not exist"
            raise ValueError(f"--drafter {args.drafter} {problem}")
        # what can be checked without the models, before any is loaded (the drafter loads with the target's
        # embedding at the first batch, which checks the vocabularies; nothing is written before the last batch).
        # One policy for every batch: a bandit keeps its statistics across them.
        tree = parse_policy("bandit" if args.tree is None else args.tree, persistent=True)
        plan_call(tree, resolve_sampling(None, args.temperature), verifier=args.verifier, lookup_tokens=0,
                  batched=True)
        dtype = resolve_dtype(args.dtype, args.device)
        generate = DraftedGenerate(lambda embedding: load_drafter(args.drafter, device=args.device, dtype=dtype,
                                                                  embedding=embedding), tree, args.verifier)
    counts = plain.run(args, generate=generate)
    if generate is not None:
        print(generate.summary())
    print(f"regenerate: {plain.summary(counts, args.truncated)}")
    return 0
