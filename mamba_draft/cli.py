"""`mamba-draft` command line: a dispatch table of subcommands, each imported only when it runs."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help). Each module exposes add_arguments(parser) and run(args).
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("mamba_draft.convert", "convert a drafter checkpoint between HF and mamba_ssm formats"),
    "generate": ("tree_search.cli", "generate text with a target model and a Mamba tree drafter"),
    "autojudge": ("tree_search.autojudge.cli", "mine labelled mismatches and train an AutoJudge classifier"),
    "export": ("training.export", "export a DeepSpeed training checkpoint to an HF (or mamba_ssm) directory"),
    "eval": ("training.evaluate", "zero-shot multiple-choice accuracy and held-out perplexity of a model"),
    "demo": ("benchmarks.demo", "train a demo target + drafter on this machine and compare decoding methods"),
    "bench": ("benchmarks.bench", "Spec-Bench-style side-by-side benchmark of decoding methods"),
    "bench-drafters": ("benchmarks.bench_drafters", "drafter step latency and memory vs context length"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: mamba-draft COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `mamba-draft COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"mamba-draft: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"mamba-draft {name}", description=module.__doc__ or help_)
    module.add_arguments(parser)
    result = module.run(parser.parse_args(rest))
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
