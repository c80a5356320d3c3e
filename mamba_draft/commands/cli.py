"""`mamba-draft` command line: a dispatch table of subcommands, each imported only when it runs.

The dispatcher sits above every package (mamba_draft, tree_search, training, benchmarks): the table names each
command's module as a string, and tests/test_layering.py reads those strings as imports."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import mamba_draft  # noqa: F401  (its __init__ sets the CPU BLAS dispatch before any command multiplies a matrix)

# subcommand -> (module, one-line help). Each module exposes add_arguments(parser) and run(args);
# the dispatcher adds --threads and --debug to every command (and sets torch's thread count) so no module repeats
# them, and turns any exception a command raises into one line, `mamba-draft COMMAND: error: MESSAGE` (exit 1).
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("mamba_draft.convert", "convert a drafter checkpoint between HF and mamba_ssm formats"),
    "generate": ("tree_search.cli", "generate text with a target model, drafted by a drafter (Mamba or Transformer) "
                 "or plainly"),
    "autojudge": ("tree_search.autojudge.cli", "mine labelled mismatches and train an AutoJudge classifier"),
    "train": ("training.train", "train a drafter (or a small target) from a YAML config, on one process"),
    "export": ("training.export", "export a DeepSpeed training checkpoint to an HF (or mamba_ssm) directory"),
    "eval": ("training.evaluate", "zero-shot multiple-choice accuracy and held-out perplexity of a model"),
    "make-data": ("training.make_data", "the data engine: the target writes prompts (Magpie) and answers them"),
    "serve": ("tree_search.serve", "an OpenAI-compatible server: concurrent requests decode together as lossless "
              "tree batches"),
    "regenerate": ("mamba_draft.benchmarks.regenerate",
                   "regenerate chat replies with the target for distillation (optionally drafted)"),
    "demo": ("mamba_draft.benchmarks.demo", "the shipped SmolLM2 target and its drafter against plain decoding on "
             "held-out Spec-Bench questions"),
    "bench": ("mamba_draft.benchmarks.bench", "Spec-Bench-style side-by-side benchmark of decoding methods"),
    "serve-bench": ("mamba_draft.benchmarks.serve_bench",
                    "N clients at once against one at a time on `serve`, per tree policy"),
    "tax": ("mamba_draft.benchmarks.tax",
            "what the exact target path costs against transformers' plain model, per forward"),
    "bench-drafters": ("mamba_draft.benchmarks.bench_drafters", "drafter step latency and memory vs context length"),
    "gpu-timings": ("mamba_draft.benchmarks.gpu_timings",
                    "GPU timings: drafter steps, tree drafting, verification, projected speedup"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: mamba-draft COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `mamba-draft COMMAND --help` for a command's options. Every command takes --threads N and",
              f"--debug (an error's full traceback instead of one line; also {DEBUG_ENV}=1)."]
    return "\n".join(lines)


DEBUG_ENV = "MAMBA_DRAFT_DEBUG"


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line, `mamba-draft COMMAND: error: MESSAGE` (exit 2); --help shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _thread_count(value: str) -> int:
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return int(value)


def _add_globals(parser: argparse.ArgumentParser, default=None) -> None:
    """--threads and --debug on a command and on each of its sub-actions (`autojudge mine --threads 4`)."""
    parser.add_argument("--threads", type=_thread_count, default=default,
                        help="torch CPU threads for this command (default: torch's choice, all cores)")
    parser.add_argument("--debug", action="store_true", default=default if default is not None else False,
                        help=f"show the full traceback of an error (also: {DEBUG_ENV}=1)")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                # SUPPRESS: a sub-action that was not given --threads / --debug keeps the command-level value
                _add_globals(sub, default=argparse.SUPPRESS)


def build_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand: the module's own arguments plus the global --threads and --debug."""
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    # the module's docstring as written (its usage lines and tables keep their layout)
    parser = _Parser(prog=f"mamba-draft {name}", description=module.__doc__ or help_,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    _add_globals(parser)
    return parser


def _one_line(err: BaseException) -> str:
    """An exception as one line: its message with inner newlines folded (transformers' OSErrors span several)."""
    message = " ".join(str(err).split())
    if message and isinstance(err, (ValueError, OSError, RuntimeError, ImportError)):
        return message
    # KeyError('x') prints as 'x' and an AssertionError often as nothing: name the type of such exceptions
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"mamba-draft: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    parser = build_parser(name)
    args = parser.parse_args(rest)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        result = importlib.import_module(COMMANDS[name][0]).run(args)
    except KeyboardInterrupt:
        if debug:
            raise
        return 130  # the shell's code for SIGINT, without a traceback
    except Exception as err:  # SystemExit (a command's own one-line usage errors) passes through
        if debug:
            raise  # the full traceback, and the exception itself for a caller of main()
        print(f"{parser.prog}: error: {_one_line(err)}", file=sys.stderr)
        return 1
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
