"""A server's Prometheus metrics (`GET /metrics`, text format): requests by outcome, the queue and the running rows,
prompt and generated tokens, time to first token and per output token, and what speculation does on the traffic —
tokens drafted and accepted (llama-server's `draft_n` / `draft_n_accepted`, vLLM's spec-decode counters), rounds, τ,
and the tree shapes the bandit pulled. One registry per server (`ServerMetrics`), every series labelled by model.
"""
from __future__ import annotations

# seconds: a first token after a queue wait and a prefill; a token of a few ms on a CPU step
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServerMetrics:
    """The counters of one server; `observe` takes a finished request, `render` writes the exposition."""

    def __init__(self, model: str, queue_length=None, running_rows=None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry, self.model = CollectorRegistry(), model
        kw = {"labelnames": ("model",), "registry": self.registry}
        self.requests = Counter("mamba_draft_requests", "Requests finished, by outcome (stop, length, cancelled, "
                                "error)", labelnames=("model", "outcome"), registry=self.registry)
        self.prompt_tokens = Counter("mamba_draft_prompt_tokens", "Prompt tokens of finished requests", **kw)
        self.generation_tokens = Counter("mamba_draft_generation_tokens", "Tokens generated", **kw)
        self.first_token = Histogram("mamba_draft_time_to_first_token_seconds", "From a request's arrival to its "
                                     "first generated token", buckets=FIRST_TOKEN_BUCKETS, **kw)
        self.per_token = Histogram("mamba_draft_time_per_output_token_seconds", "A request's seconds per generated "
                                   "token after its first", buckets=TOKEN_BUCKETS, **kw)
        self.drafted = Counter("mamba_draft_draft_tokens", "Tokens drafted and verified beyond each round's root",
                               **kw)
        self.accepted = Counter("mamba_draft_draft_accepted_tokens", "Drafted tokens the target accepted", **kw)
        self.rounds = Counter("mamba_draft_verify_rounds", "Verification rounds (one target forward each, per row)",
                              **kw)
        self.tau = Gauge("mamba_draft_mean_accepted_tokens", "τ: tokens committed per verification round, over "
                         "every request served", **kw)
        self.arm_pulls = Counter("mamba_draft_arm_pulls", "Rounds of each tree shape the policy pulled",
                                 labelnames=("model", "arm"), registry=self.registry)
        for name, about, read in (("mamba_draft_queue_length", "Requests waiting for the engine", queue_length),
                                  ("mamba_draft_running_rows", "Requests in the batch being decoded", running_rows)):
            if read is not None:
                Gauge(name, about, **kw).labels(model).set_function(read)
        self.committed = self.verified = 0

    def observe(self, outcome: str, prompt_tokens: int, tokens: int, first_token_s: float | None = None,
                per_token_s: float | None = None, stats=None) -> None:
        """One finished request: its outcome, tokens, latencies and (where it was decoded) its GenerateStats."""
        m = self.model
        self.requests.labels(m, outcome).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(tokens)
        if first_token_s is not None:
            self.first_token.labels(m).observe(first_token_s)
        if per_token_s is not None:
            self.per_token.labels(m).observe(per_token_s)
        if stats is None:
            return
        accepted = sum(stats.accepted_lengths) - len(stats.accepted_lengths)  # the bonus token is not a draft's
        self.drafted.labels(m).inc(stats.drafted_tokens)
        self.accepted.labels(m).inc(max(accepted, 0))
        self.rounds.labels(m).inc(stats.rounds)
        self.committed += sum(stats.accepted_lengths)
        self.verified += len(stats.accepted_lengths)
        if self.verified:
            self.tau.labels(m).set(self.committed / self.verified)

    def pulled(self, arms: dict[str, dict]) -> None:
        """A batch's pulls per tree shape (`GenerateStats.arms`)."""
        for arm, stats in arms.items():
            if stats.get("pulls"):
                self.arm_pulls.labels(self.model, arm).inc(stats["pulls"])

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
