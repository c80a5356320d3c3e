"""Drafter step latency and memory vs context length: a Mamba drafter vs a Transformer drafter of similar size, both
through the drafter interface the tree engine drafts with (`MambaDrafter`, `TransformerDrafter`)."""
from __future__ import annotations

import argparse
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mamba_draft.benchmarks.methods import timed
from mamba_draft.benchmarks.report import line_plot, markdown_table, write_json, write_text
from mamba_draft.devices import check_device, resolve_dtype
from mamba_draft.dtypes import DTYPES, dtype_name, parse_dtype

BASE_CONTEXT = 64  # ratios are reported against the step time at this context (the reference point)
PREFILL_CHUNK = 1024  # the Transformer prefills in chunks, bounding attention temporaries at long contexts


@dataclass
class DrafterBenchConfig:
    contexts: tuple[int, ...] = (256, 1024, 4096, 8192)
    arch: str = "mamba1"
    d_model: int = 512
    n_layer: int = 8               # Mamba layers; the Transformer's depth is chosen to match the parameter count
    vocab_size: int = 4096
    steps: int = 64                # timed decoding steps per context, contexts in turn (median reported)
    warmup: int = 3
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied embedding / head counts once


def build_mamba(config: dict, backend: str, seed: int, device: torch.device, dtype: torch.dtype):
    """A MambaDrafter of `config` (MambaConfig's fields), its random weights seeded `seed`."""
    from mamba_draft import MambaDrafter
    from mamba_draft.config import MambaConfig

    torch.manual_seed(seed)
    return MambaDrafter(MambaConfig(**config), backend=backend).to(device=device, dtype=dtype).eval()


def build_llama(cfg: DrafterBenchConfig, target_params: int, device: torch.device, dtype: torch.dtype):
    """A Llama of the same width whose depth brings its parameter count closest to `target_params`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def config(layers: int) -> LlamaConfig:
        return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=layers,
                           num_attention_heads=max(1, cfg.d_model // 64), intermediate_size=cfg.d_model * 8 // 3,
                           max_position_embeddings=2 * max(cfg.contexts + (BASE_CONTEXT,)) + cfg.steps + cfg.warmup,
                           tie_word_embeddings=True)

    def size(layers: int) -> int:
        c = config(layers)
        block = 4 * c.hidden_size**2 + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
        return layers * block + c.vocab_size * c.hidden_size + c.hidden_size

    layers = min(range(1, 4 * cfg.n_layer + 1), key=lambda n: abs(size(n) - target_params))
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM._from_config(config(layers), attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval()


def time_round_robin(steps: dict, device: torch.device, warmup: int, n_steps: int, block: int = 8) -> dict:
    """Median seconds of one call of each `steps[key]()` (one decoded token each), after `warmup` untimed calls.

    The keys take turns in blocks of `block` timed steps, so drift in the machine's load (a shared CPU) hits every
    context alike instead of showing up as a context effect. Each block starts with one untimed step: a drafter
    decodes one context step after step, so caches warm from that context's previous step are the realistic case,
    not caches just flushed by another context's 100 MB KV cache.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {key: [] for key in steps}
    for _ in range(-(-n_steps // block)):
        for key, step in steps.items():
            step()
            for _ in range(block):
                times[key].append(timed(step, device)[1])
    return {key: statistics.median(t) for key, t in times.items()}


@torch.no_grad()
def prepare(drafter, context: int, cfg: DrafterBenchConfig, device: torch.device):
    """Prefill a random `context`-token prompt through the drafter interface, PREFILL_CHUNK tokens at a time; returns
    its record (prefill time, state size) and a step function, after one untimed step."""
    gen = torch.Generator().manual_seed(cfg.seed + context)
    prompt = torch.randint(0, cfg.vocab_size, (1, context), generator=gen).to(device)

    def prefill():
        logits, state = drafter.prefill(prompt[:, :PREFILL_CHUNK], max_batch=1)
        for start in range(PREFILL_CHUNK, context, PREFILL_CHUNK):
            logits = drafter.extend(prompt[:, start : start + PREFILL_CHUNK], state, last_only=True)
        return logits, state

    (logits, state), prefill_s = timed(prefill, device)
    token = logits.argmax(-1)

    @torch.no_grad()
    def step():
        nonlocal token
        token = drafter.step(token, state).argmax(-1)

    step()
    return {"context": context, "prefill_ms": 1e3 * prefill_s, "cache_bytes": drafter.row_bytes(context)}, step


def with_peak(device: torch.device, fn, weight_bytes: int):
    """(fn(), the peak bytes it needed, weights included): what was allocated before it (the other contexts' states,
    kept alive for round-robin timing) is not counted. CUDA only: None on CPU, where cache_bytes is the measure."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    out = fn()
    return out, torch.cuda.max_memory_allocated(device) - held + weight_bytes


def run_bench(cfg: DrafterBenchConfig, progress: bool = True) -> dict:
    """Measure both drafters at BASE_CONTEXT and every configured context; returns a JSON-able dict."""
    from tqdm import tqdm

    from mamba_draft.transformer import TransformerDrafter

    contexts = sorted(set(cfg.contexts) | {BASE_CONTEXT})
    device, dtype = torch.device(cfg.device), parse_dtype(cfg.dtype)

    shape = {"arch": cfg.arch, "d_model": cfg.d_model, "n_layer": cfg.n_layer, "vocab_size": cfg.vocab_size}
    mamba = build_mamba(shape, "auto", cfg.seed, device, dtype)
    llama = build_llama(cfg, n_params(mamba), device, dtype)
    models = {f"Mamba ({cfg.arch})": mamba, "Transformer (Llama)": TransformerDrafter(llama)}
    results = {}
    bar = tqdm(total=len(models) * (len(contexts) + 1), desc="bench-drafters", disable=not progress)
    for name, model in models.items():
        weights = {t.data_ptr(): t for t in model.state_dict().values()}.values()  # tied tensors once
        weight_bytes = sum(t.numel() * t.element_size() for t in weights)
        prepare(model, BASE_CONTEXT, cfg, device)  # untimed: first-call allocations and lazy init
        rows, steps = [], {}
        for context in contexts:
            bar.set_postfix_str(f"{name}: prefill {context}")
            (row, steps[context]), peak = with_peak(device, lambda: prepare(model, context, cfg, device), weight_bytes)
            rows.append(row | {"peak_bytes": peak})
            bar.update()
        bar.set_postfix_str(f"{name}: {cfg.steps} steps per context, round robin")
        step_s = time_round_robin(steps, device, cfg.warmup, cfg.steps)
        bar.update()
        rows = [r | {"step_ms": 1e3 * step_s[r["context"]], "ratio_to_64": step_s[r["context"]] / step_s[BASE_CONTEXT]}
                for r in rows]
        results[name] = {"params": n_params(model), "weight_bytes": weight_bytes, "rows": rows}
        del steps  # free this model's states / KV caches before the next model
    bar.close()
    if device.type == "cuda":
        name, memory = (torch.cuda.get_device_name(device),
                        "peak = torch.cuda.max_memory_allocated over prefill + decoding (weights included)")
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
        memory = ("CPU: decoding memory = bytes one state row holds at that context (`row_bytes`: the recurrent state "
                  "of Mamba, the keys and values of a Transformer); weights listed separately")
    return {"config": asdict(cfg), "device": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "memory_measure": memory, "models": results}


def markdown_report(result: dict) -> str:
    header = ["drafter", "params", "context", "step ms", "ratio to ctx 64", "prefill ms", "state / KV cache MiB"]
    if not result["device"].startswith("CPU"):
        header.append("peak MiB")
    rows = [[name, f"{m['params'] / 1e6:.1f}M", r["context"], f"{r['step_ms']:.2f}", f"{r['ratio_to_64']:.2f}",
             f"{r['prefill_ms']:.0f}", f"{r['cache_bytes'] / 2**20:.2f}",
             *([] if r["peak_bytes"] is None else [f"{r['peak_bytes'] / 2**20:.0f}"])]
            for name, m in result["models"].items() for r in m["rows"]]
    return (f"Device: {result['device']}, torch {result['torch']}, {result['config']['dtype']}. "
            f"{result['memory_measure']}.\n\n" + markdown_table(header, rows))


def write_outputs(result: dict, out_dir: Path) -> dict[str, Path]:
    contexts = [r["context"] for r in next(iter(result["models"].values()))["rows"]]
    paths = {"json": out_dir / "bench_drafters.json", "markdown": out_dir / "bench_drafters.md",
             "latency_png": out_dir / "bench_drafters_latency.png", "memory_png": out_dir / "bench_drafters_memory.png"}
    write_json(paths["json"], result)
    write_text(paths["markdown"], markdown_report(result))
    models = result["models"]
    line_plot(paths["latency_png"], contexts, {n: [r["step_ms"] for r in m["rows"]] for n, m in models.items()},
              f"Drafter decoding step latency ({result['device']})", "context length (tokens)", "ms per token")
    on_cpu = result["device"].startswith("CPU")  # no peak there: the state's bytes
    mem_key, mem_label = ("cache_bytes", "state / KV cache MiB") if on_cpu else ("peak_bytes", "peak MiB")
    line_plot(paths["memory_png"], contexts, {n: [r[mem_key] / 2**20 for r in m["rows"]] for n, m in models.items()},
              "Drafter decoding memory", "context length (tokens)", mem_label)
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DrafterBenchConfig()
    parser.add_argument("--contexts", type=int, nargs="+", default=list(d.contexts), help="context lengths to measure")
    parser.add_argument("--arch", choices=("mamba1", "mamba2"), default=d.arch)
    parser.add_argument("--d-model", type=int, default=d.d_model, help="width of both drafters")
    parser.add_argument("--n-layer", type=int, default=d.n_layer, help="Mamba depth (the Transformer's is matched)")
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size)
    parser.add_argument("--steps", type=int, default=d.steps, help="timed decoding steps per context")
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="both drafters' dtype (auto, the default: bfloat16 where the device has native bf16 "
                        "products, else float32, as every command)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--out", type=Path, required=True, help="directory for JSON, markdown and PNG plots")


def run(args: argparse.Namespace) -> int:
    if not args.contexts or min(args.contexts) < 1:
        raise ValueError(f"--contexts must be positive integers, got {args.contexts}")
    for name in ("d_model", "n_layer", "vocab_size", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_device(args.device)
    same = ("arch", "d_model", "n_layer", "vocab_size", "steps", "warmup", "device", "seed")  # fields set as given
    dtype = dtype_name(resolve_dtype(args.dtype, args.device))
    result = run_bench(DrafterBenchConfig(contexts=tuple(args.contexts), dtype=dtype,
                                          **{field: getattr(args, field) for field in same}))
    paths = write_outputs(result, args.out)
    print(markdown_report(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
