"""Data-parallel attention: each rank serves its own requests through attention, the MoE layers
span every process. This is how SGLang serves DeepSeek models (``--enable-dp-attention``), and fits
DeepSeek-V4, whose single KV head, compressors and indexer cannot be split over heads: under tensor
parallelism every process holds the whole KV cache of every request, under DP attention each rank
holds the cache of its own requests only, so D ranks hold D times the requests.

What runs where (``--tensor-parallel-size N --data-parallel-size D --enable-dp-attention``, D
dividing N; data-parallel rank d is processes d*N/D .. (d+1)*N/D - 1):

- Every data-parallel rank is a whole engine core (core/engine.py) with its own scheduler, KV
  manager (radix cache, page pools, windows), token table and sampler, in its first process, and
  the whole model but for the experts, tensor-parallel over its N/D processes as the model is
  under tensor parallelism alone (config.attention_tp_size; at D = N attention, compressors,
  indexer, embedding and LM head are whole on every process, SGLang's ``--enable-dp-lm-head``, and
  there is no collective outside the MoE layers). The rank's other processes follow its steps as
  tensor-parallel ranks do (``Step``, or ``Idle`` when it has nothing scheduled; followers.py).
- The MoE layers span all N processes (core/distributed/moe.py): with ``--expert-parallel`` each
  holds E/N experts and sends its tokens to them and back with all_to_all; otherwise every process
  holds a share of every expert, the processes' tokens are all-gathered, the shares all-reduced,
  and each keeps its rows. The processes of one rank hold the same tokens: each sends (or gives
  the gather) its slice of them, and the rank's processes gather the slices' outputs.
- Rank 0 (the engine process the front talks to) is also the controller: each new request goes to
  the rank that caches its longest prefix, or the least loaded (dp_router.py), which keeps it to
  the end; aborts, stop strings and the zeroing of counters follow it there. The first process of
  every other rank is a worker process (worker.py) that gets, with each step, what rank 0 routed to
  it (``RankRequests``), runs one step of its core, and answers with its outputs (``RankOutputs``).
- Lockstep: every step of rank 0 is one step of every rank, and every step runs exactly one
  forward on every process. A rank with nothing scheduled runs an idle forward (``idle_forward``,
  moe.py): its MoE layers' exchanges, in layer order, with zero tokens, so the others' collectives
  meet it; or, where the others replay a graph (decode, verify or prefill), the same graph on
  padding only (``ModelRunner.idle``; the ranks agree on the graph and bucket before each step,
  core/graph_choice.py).

- Speculative decoding: each rank drafts for its own requests and verifies them (core/spec); a
  verify step (K+1 tokens a sequence) replays a verify graph where every rank's step fits one (a
  rank with fewer sequences or none padded), else a prefill graph where every rank's tokens fit
  one, else all run it eagerly, each its own tokens. A proposer whose
  forwards reach the MoE exchanges (MTP's next-n layer, whose MoE spans the ranks too) agrees with
  the other ranks on the step's number of drafting forwards before the target's, and runs those it
  lacks with no tokens (core/spec/mtp.py), the rank's other processes with it (``DraftCount``,
  ``Draft``); n-gram lookup runs none and a draft model is a model of
  this process alone, without collectives.
- The start-up warm-up (core/warmup.py): rank 0 drives it, every rank running every phase on
  copies of its requests, in the same steps.
"""

from __future__ import annotations

from ..config import EngineConfig
from ..errors import EngineError, rebuild
from ..outputs import EngineCoreOutput
from ..sampling_params import SamplingParams
from .dp_router import DataParallelRouter
from .messages import AddRequest, RankOutputs, RankRequests, RankStats, decoder, encoder
from .workers import Workers


class DataParallelRanks:
    """Rank 0's view of the other data-parallel ranks: whose each request is, what to tell each rank
    with the next step, and their outputs and gauges after it."""

    def __init__(self, workers: Workers, config: EngineConfig, pages_per_rank: int) -> None:
        self.workers = workers
        self.ranks = config.data_parallel_size
        # the sockets of each data-parallel rank's first process (it schedules the rank), in rank order
        self.conns = workers.conns[config.attention_tp_size - 1::config.attention_tp_size]
        self.router = DataParallelRouter(self.ranks, config.load_balance_method, config.load_balance_threshold,
                                         config.page_size, pages_per_rank)
        self.owner: dict[str, int] = {}  # request id -> its rank (1..), until its last output
        self.load = [0] * self.ranks  # requests outstanding per rank (rank 0's are counted by the core)
        self.stats: list[RankStats] = [RankStats(0, 0, 0.0, 0, 0, 0)] * (self.ranks - 1)
        self._next = [RankRequests([], [], []) for _ in range(self.ranks - 1)]

    def place(self, ids: list[int], local_load: int) -> int:
        """The rank a new prompt ``ids`` goes to (rank 0's load is ``local_load``)."""
        self.load[0] = local_load
        return self.router.place(ids, self.load)

    def add(self, rank: int, request_id: str, ids: list[int], params: SamplingParams) -> None:
        self.owner[request_id] = rank
        self.load[rank] += 1
        self._next[rank - 1].adds.append(AddRequest(request_id, ids, params))

    def owns(self, request_id: str) -> bool:
        return request_id in self.owner

    def abort(self, request_id: str) -> None:
        self._next[self.owner[request_id] - 1].aborts.append(request_id)

    def finish(self, request_id: str, index: int, stop: str) -> None:
        self._next[self.owner[request_id] - 1].finishes.append((request_id, index, stop))

    def reset_counters(self) -> None:
        """Zero every rank's counters with the next step; their totals read as zero until then."""
        for msg in self._next:
            msg.reset_counters = True
        self.stats = [RankStats(r.num_running, r.num_waiting, r.kv_usage, 0, 0, 0, None) for r in self.stats]

    def reset_prefix_caches(self) -> None:
        """Empty every other rank's prefix cache with the next step."""
        for msg in self._next:
            msg.reset_prefix_cache = True

    def busy(self) -> bool:
        return bool(self.owner)

    def send(self) -> None:
        """Start a step on every other rank, with what was routed to it since the last one."""
        self.workers.check()
        try:
            for conn, msg in zip(self.conns, self._next):
                conn.send_bytes(encoder.encode(msg))
        except OSError as exc:
            self.workers.explain(exc)
            raise
        self._next = [RankRequests([], [], []) for _ in range(self.ranks - 1)]

    def collect(self) -> tuple[list[EngineCoreOutput], list[tuple[str, EngineError]]]:
        """Every other rank's outputs and failures of the step; requests that ended leave their rank."""
        outputs, failures = [], []
        for rank, conn in enumerate(self.workers.replies, start=1):
            try:
                msg = decoder.decode(conn.recv_bytes())
            except (EOFError, OSError) as exc:
                self.workers.explain(exc)
                raise
            assert isinstance(msg, RankOutputs)
            self.stats[rank - 1] = msg.stats
            outputs += msg.outputs
            failures += [(rid, rebuild(code, detail, field)) for rid, code, detail, field in msg.failures]
            for rid in [o.request_id for o in msg.outputs if o.finished] + [rid for rid, *_ in msg.failures]:
                if self.owner.pop(rid, None) is not None:
                    self.load[rank] -= 1
        return outputs, failures


def serve_requests(conn, replies, core) -> None:
    """A data-parallel rank other than 0: per ``RankRequests`` take its requests, aborts and stop
    strings, run one step of ``core`` (an ``EngineCore``; idle, it still runs its exchanges) and
    answer with what changed; until ``Stop`` or until rank 0 closes the pipe."""
    while True:
        try:
            msg = decoder.decode(conn.recv_bytes())
        except EOFError:
            return
        if not isinstance(msg, RankRequests):
            return
        if msg.reset_counters:
            core.reset_counters()
        if msg.reset_prefix_cache:
            core.reset_prefix_cache()
        for a in msg.adds:
            try:
                core.add_request(a.request_id, a.prompt_token_ids, a.params)
            except EngineError as exc:
                core.failures.append((a.request_id, exc))
        ended = [core.abort_request(rid) for rid in msg.aborts]
        ended += [core.finish_sequence(rid, index, stop) for rid, index, stop in msg.finishes]
        outputs = [o for o in ended if o is not None] + core.step_outputs()
        failures = [(rid, exc.code.value, exc.detail, exc.field) for rid, exc in core.take_failures()]
        s = core.stats()
        stats = RankStats(s.num_running, s.num_waiting, s.kv_usage, s.prefix_cache_queries, s.prefix_cache_hits,
                          s.num_preemptions, s.spec)
        replies.send_bytes(encoder.encode(RankOutputs(outputs, failures, stats)))
