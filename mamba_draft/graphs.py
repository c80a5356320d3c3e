"""CUDA-graph runner for the drafter's one-token steps (the pattern of mamba_ssm's `DecodingCGCache`).

A `StepRunner` steps row ranges of one `DrafterState`, first forking them from parent rows when asked. With
`use_graphs` (default: on CUDA) each (start, stop, fork) is captured once and replayed: the runner owns the static
inputs the graphs read, so any tree shape that steps the same rows shares the graph. Their output is copied inside
the graph into the runner's `logits`: the logits returned for rows [start:stop] stay valid until the next `run` over
any of those rows. Graphs bake in the weights' and state's addresses and the step's kernels (`drafter_key`): a runner
whose `key` differs from the drafter's must not be replayed.
"""
from __future__ import annotations

import itertools

import torch


def weights_key(module: torch.nn.Module) -> tuple:
    """Address, dtype and device of every parameter and buffer: what graphs built on a module's weights depend on
    (addresses catch reallocations such as `.to(bfloat16).to(float32)`, which dtype and device alone miss)."""
    return tuple((t.data_ptr(), t.dtype, t.device) for t in itertools.chain(module.parameters(), module.buffers()))


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: a copy from pageable memory would, so on CUDA it goes
    through pinned memory, non-blocking."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def drafter_key(drafter) -> tuple:
    """What a drafter's state and captured graphs depend on: its weights (`weights_key`), state dtype and backend."""
    return weights_key(drafter), drafter.state_dtype, drafter.backend


class StepRunner:
    """Runs `drafter.step` on row ranges of `state`, replaying one captured CUDA graph per (start, stop, fork)."""

    def __init__(self, drafter, state, use_graphs: bool | None = None) -> None:
        self.drafter = drafter
        self.state = state
        self.key = drafter_key(drafter)
        device = state.device
        # graphs need fixed shapes: a Transformer drafter's forward widens with its longest row (not capturable)
        capturable = device.type == "cuda" and drafter.capturable
        self.use_graphs = capturable if use_graphs is None else use_graphs
        # Static inputs and output of every graph: allocated outside any capture, never reassigned.
        self.tokens, self.parents = (torch.zeros(state.max_batch, dtype=torch.long, device=device) for _ in range(2))
        self.logits: torch.Tensor | None = None  # (rows, V), allocated at the first capture
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = None  # one memory pool for all graphs, created at the first capture

    def run(self, start: int, stop: int, tokens: torch.Tensor, parents: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start:stop] <- rows `parents` (if given), then step them with `tokens` (stop - start ids, row-major
        in any shape) -> the logits (stop - start, V); with graphs, a view of `self.logits`."""
        fork = parents is not None
        if not self.use_graphs:
            if fork:
                self.state.gather_(start, parents)
            return self.drafter.step(tokens.reshape(-1), self.state.rows(start, stop))
        self.tokens[start:stop].view(tokens.shape).copy_(tokens)
        if fork:
            self.parents[start:stop].copy_(parents)
        key = (start, stop, fork)
        graph = self.graphs.get(key)
        if graph is None:
            if self.logits is None:
                self.logits = torch.zeros(self.state.max_batch, self.drafter.vocab_size, dtype=self.drafter.dtype,
                                          device=self.tokens.device)

            def body() -> None:  # the captured work: fork (static parents), step (static tokens), copy the logits out
                if fork:
                    self.state.gather_(start, self.parents[start:stop])
                self.logits[start:stop].copy_(self.drafter.step(self.tokens[start:stop], self.state.rows(start, stop)))

            graph = self.graphs[key] = self._capture(body, start, stop)
        graph.replay()
        return self.logits[start:stop]

    def invalidate(self) -> None:
        """Drop every graph and the pool (the next `run` per key captures again)."""
        self.graphs.clear()
        self.pool = None

    def _capture(self, body, start: int, stop: int) -> torch.cuda.CUDAGraph:
        """Capture `body` into the shared pool; the warm-ups run on the live rows, restored afterwards."""
        rows = self.state.rows(start, stop)
        backup = rows.clone()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = capture_graph(body, self.pool, self.state.device)
        rows.conv.copy_(backup.conv)
        rows.ssm.copy_(backup.ssm)
        return graph


def capture_graph(body, pool, device) -> torch.cuda.CUDAGraph:
    """Capture `body` into `pool` after two warm-up runs on a side stream (Triton compiles, cuBLAS workspaces,
    buffer allocation); the caller makes those runs harmless."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph
