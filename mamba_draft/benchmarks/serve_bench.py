"""Load on `mamba-draft serve`: N clients at once against the same requests one at a time, for each tree policy, in
one process (servers on loopback, the real `openai` client), the policies taking turns repeat by repeat.

    mamba-draft serve-bench --target smollm2 --drafter smollm2 [--clients 8] [--max-tokens 64] [--trees auto none]

The prompts are the first turns of held-out (odd-id) Spec-Bench questions, one per category in turn; greedy. Prints,
per policy, the tokens per second of one client (the requests in sequence) and of N clients at once (all the
requests' tokens over the wall time until the last one ends), and how many concurrent outputs equal the same
request's output alone; and the time to the first streamed token of a 200-token prompt against the time the engine
takes for that prompt's first token in-process (`SpeculativeDecoder.generate` with max_new_tokens=1: its prefill and
one step), medians of alternating runs.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tree_search.cli import add_model_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trees", nargs="+", default=["auto", "none"], metavar="SPEC",
                        help="tree policies to compare (none: no speculation, plain decoding rounds of the same "
                        "batches); default: auto none")
    parser.add_argument("--repeats", type=int, default=2)


def questions(count: int) -> list[str]:
    """The first turns of `count` odd-id Spec-Bench questions, taking the categories in turn."""
    from mamba_draft.benchmarks.real_pair import round_robin
    from mamba_draft.heldout import is_heldout, read_spec_bench

    return [r["turns"][0] for r in round_robin([r for r in read_spec_bench() if is_heldout(r)])][:count]


class LoopbackServer:
    """uvicorn serving one app (serving `model`) on a free loopback port, in a thread; `client` speaks to it."""

    def __init__(self, app, model: str = "model") -> None:
        import openai
        import uvicorn

        self.app, self.model = app, model
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=600)

    def first_token(self, ids: list[int]) -> float:
        """Seconds until the first streamed content of a completion of prompt `ids` (as raw text)."""
        start = time.perf_counter()
        with self.client.completions.create(model=self.model, prompt=ids, max_tokens=8, temperature=0,
                                            stream=True) as stream:
            next((chunk for chunk in stream if chunk.choices and chunk.choices[0].text), None)
            return time.perf_counter() - start

    def ask(self, prompt: str, max_tokens: int) -> tuple[str, int]:
        reply = self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=max_tokens, temperature=0)
        return reply.choices[0].message.content, reply.usage.completion_tokens

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


PREFILL_TOKENS = 200


def time_to_first_token(server: LoopbackServer, generator, prompts: list[str], repeats: int) -> tuple[float, float]:
    """Median seconds to the first streamed token of a PREFILL_TOKENS-token prompt through the server, and to the
    first token of the same prompt in-process (the server's decoder, max_new_tokens=1), alternating."""
    import torch

    from mamba_draft.cpu_threads import release_openmp_workers

    text = " ".join(prompts * (1 + PREFILL_TOKENS // 16))
    ids = generator.tokenizer(text)["input_ids"][:PREFILL_TOKENS]
    streamed, direct = [], []
    for _ in range(2 * repeats + 1):
        streamed.append(server.first_token(ids))
        start = time.perf_counter()
        server.app.state.batcher.decoder.generate(torch.tensor([ids]), max_new_tokens=1, temperature=0.0)
        direct.append(time.perf_counter() - start)
        release_openmp_workers()  # this thread's team would make the server's engine thread sleep at every region
    return statistics.median(streamed[1:]), statistics.median(direct[1:])


def run(args: argparse.Namespace) -> int:
    from tree_search.cli import load_generator
    from tree_search.generate import SpeculativeDecoder
    from tree_search.sampling import SamplingParams
    from tree_search.serve import create_app

    if args.clients < 1 or args.max_tokens < 1 or args.repeats < 1:
        raise ValueError("--clients, --max-tokens and --repeats must be >= 1")
    trees = args.trees
    generator = load_generator(args, args.drafter, SamplingParams(temperature=0.0), batched=True,
                               command="serve-bench")
    servers = {}
    for tree in trees:  # one engine per policy, on the same models
        generator.decoder = SpeculativeDecoder(generator.target, generator.drafter, tree=tree,
                                               tokenizer=generator.tokenizer,
                                               integer_products=generator.decoder.options.integer_products)
        servers[tree] = LoopbackServer(create_app(generator, "model", max_batch=args.clients))
    prompts = questions(args.clients)
    alone_rate = {t: [] for t in trees}
    crowd_rate = {t: [] for t in trees}
    same = {t: 0 for t in trees}
    try:
        for server in servers.values():  # warm, alone and all at once: compiled step, verify-cost probes, state rows
            server.ask(prompts[0], 8)
            with ThreadPoolExecutor(len(prompts)) as pool:
                list(pool.map(lambda p, server=server: server.ask(p, 8), prompts))
        for _ in range(args.repeats):
            for tree, server in servers.items():
                start = time.perf_counter()
                alone = [server.ask(p, args.max_tokens) for p in prompts]
                alone_rate[tree].append(sum(n for _, n in alone) / (time.perf_counter() - start))
                start = time.perf_counter()
                with ThreadPoolExecutor(len(prompts)) as pool:
                    crowd = list(pool.map(lambda p, server=server: server.ask(p, args.max_tokens), prompts))
                crowd_rate[tree].append(sum(n for _, n in crowd) / (time.perf_counter() - start))
                same[tree] += sum(a == c for a, c in zip(alone, crowd))
        first, prefill = time_to_first_token(servers[trees[0]], generator, prompts, args.repeats)
    finally:
        for server in servers.values():
            server.close()
    print(f"time to the first streamed token of a {PREFILL_TOKENS}-token prompt ({trees[0]}): {first * 1000:.0f} ms; "
          f"the engine's first token in-process: {prefill * 1000:.0f} ms ({first / prefill:.2f}x)")
    print(f"{len(prompts)} clients, {args.max_tokens} tokens each, greedy, {args.repeats} repeats (medians)")
    print("| policy | one client tok/s | all at once tok/s | ratio | outputs equal to alone |")
    print("|---|---|---|---|---|")
    for tree in trees:
        one, many = statistics.median(alone_rate[tree]), statistics.median(crowd_rate[tree])
        print(f"| {tree} | {one:.1f} | {many:.1f} | {many / one:.2f}x | {same[tree]}/{len(prompts) * args.repeats} |")
    return 0
