"""``OmniARScheduler``: vLLM's v1 scheduler for the AR stage of an omni pipeline.

The scheduler decides when a request's KV cache goes to the next stage, hands the block ids
to the model runner, and keeps the blocks allocated until the transfer resolves:

  * trigger (at most once per request, the request keeps decoding afterwards):
      - ``prefill_finished``: the prompt's KV is computed; ``seq_len`` = prompt length;
      - ``special_token``: the sentinel token is sampled; ``seq_len`` = the tokens before the
        first sentinel (the KV that exists when it is sampled);
      - otherwise when the request finishes (stopped or length-capped; never on abort):
        ``seq_len`` = its computed tokens;
  * ``schedule()`` hands every pending transfer to the omni KV connector
    (``omni_runtime.kv.connector``, loaded with ``--kv-transfer-config``), which puts it in
    the step's connector metadata;
  * the connector's workers answer per attempt (worker metadata); an answer about another
    attempt resolves nothing;
  * a finished request with an unresolved transfer keeps its blocks (held, through the
    connector's delayed free) until the transfer is acked, failed or expired; an aborted
    request's pending transfer is cancelled;
  * a preempted request's unresolved transfer keeps its blocks pinned (one extra reference,
    out of the free pool) until it resolves: vLLM's preemption frees them inside schedule(),
    and the same step could otherwise give them to another request while the transfer is
    still to be read;
  * composed with other connectors (vLLM's MultiConnector, the omni connector one of its
    children), a finished request's unresolved transfer is pinned the same way instead of
    held through the delayed free, which the MultiConnector shares with the other children;
  * a trigger acts only on what vLLM keeps of a step's output. vLLM drops the output of a
    step that was in flight when its request was preempted (in schedule(), or by a
    prefix-cache reset, after which the request may be running again when the output
    arrives) or when a streaming session's turn ended: ``special_token`` reads the new
    tokens vLLM returns to its clients, ``request_finished`` fires when vLLM finishes the
    request (only ever on a kept output), ``prefill_finished`` reads the request's computed
    tokens, which a preemption resets.

All the bookkeeping lives in :class:`~omni_runtime.transfers.ledger.TransferLedger`; this class only
wires it into vLLM's hooks. Plug it in with
``--scheduler-cls omni_runtime.sched.OmniARScheduler`` (or ``OmniARAsyncScheduler`` with
async scheduling).

Invariant: a marked transfer only names blocks whose KV is already computed (seq_len <= the
request's computed tokens at marking), so the runner may copy them at any point after
hand-off, and the blocks stay allocated and unchanged until the transfer resolves (finished:
held; preempted: pinned). Shutdown and prefix-cache resets resolve what stands in their way
as failed and give the blocks back.
"""

from __future__ import annotations

import logging
import operator
from itertools import repeat
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from omni_runtime.transfers.config import OmniKVConfigError, parse_omni_kv_config, raw_omni_kv_config
from omni_runtime.observability.observers import build_observers, downstream_stages
from omni_runtime.pipeline.protocol import KV_PARAMS_KEY
from omni_runtime.sched.handoff import Answer, Carried, HandOff
from omni_runtime.sched.outputs import OmniNewRequestData
from omni_runtime.sched.streaming import StreamProducer
from omni_runtime.transfers.ledger import VALUES, Outcome, Transfer, TransferLedger, Trigger

logger = logging.getLogger(__name__)

#: Finishes that complete a request (a stop token or string, the length cap, vLLM's repetition
#: detector); any other finish (abort, error, ignored) starts no transfer and cancels a
#: pending one.
_COMPLETED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_REPETITION,
    }
)

#: Seconds the scheduler's shutdown waits for the observers' writes (their writer threads').
_SHUTDOWN_FLUSH_SECONDS = 5.0

#: Attribute on vLLM's Request holding its latest Transfer: it dies with the request.
_TRANSFER_ATTR = "omni_kv_transfer"

#: Our connector's answers at a finish (see _connector_finished): delay the free of the
#: request's blocks, or not; no parameters (the scheduler adds the transfer's).
_DELAY_FREE: tuple[bool, None] = (True, None)
_FREE_NOW: tuple[bool, None] = (False, None)

#: A NewRequestData's request id (mapped over a step's new requests in C).
_REQ_ID = operator.attrgetter("req_id")

#: The attribute of vllm-omni's requests that carries their payload to the workers
#: (OmniNewRequestData); absent on plain vLLM's.
_PAYLOAD_ATTR = "additional_information"

#: A KV block's id (mapped over a snapshot's blocks in C: no comprehension frame per marking).
_BLOCK_ID = operator.attrgetter("block_id")


class OmniKVTransferMixin:
    """The KV-transfer behaviour, over vLLM's ``Scheduler`` or ``AsyncScheduler``."""

    #: Marks the scheduler for the omni connector, which checks that it runs under one
    #: without importing this module (vLLM's own never hands a request off).
    omni_kv_scheduler = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = self.vllm_config
        model_config = vllm_config.model_config
        try:
            cfg = parse_omni_kv_config(
                raw_omni_kv_config(vllm_config), vocab_size=model_config.get_vocab_size()
            )
        except OmniKVConfigError as exc:
            raise OmniKVConfigError(f"OmniARScheduler: {exc}") from None
        # The omni KV connector (kv/connector.py) moves the bytes: found by its marker, so that
        # scheduling imports nothing of the data path.
        self._omni = _find_omni_connector(self.connector)
        # Composed with other connectors (vLLM's MultiConnector): vLLM's delayed free is then
        # shared, counted per connector and ended by finished_sending reports, which ours
        # never sends. A finished request's unresolved transfer keeps its blocks pinned
        # instead (as a preempted one's), and vLLM frees the request as the others decide.
        self._composed = self._omni is not None and self._omni is not self.connector
        if cfg.need_send_cache and (self._omni is None or not self._omni.sends_kv):
            raise OmniKVConfigError(
                "OmniARScheduler: omni_kv_config.need_send_cache needs the omni KV connector: "
                "add --kv-transfer-config '{\"kv_connector\": \"OmniKVConnector\", "
                "\"kv_connector_module_path\": \"omni_runtime.kv.connector\", "
                "\"kv_role\": \"kv_producer\", \"kv_connector_extra_config\": "
                "{\"endpoints\": {...}}}'"
            )
        if self._omni is not None and not self.log_stats:
            # The engine collects no stats (--disable-log-stats): vLLM's make_stats would
            # drop what the connector reports, so it records nothing (see
            # _resolve_from_runner), as vLLM's own stats are not made then.
            self._omni.stop_stats()
        self.omni_kv_config = cfg
        # Streamed edges take their requests' output chunk by chunk (sched/streaming.py);
        # whole transfers go to the other edges, if any.
        to_stages = downstream_stages(vllm_config)
        whole_edges = [stage for stage in to_stages if stage not in cfg.streams]
        self._streams = self._stream_producer(cfg, model_config) if cfg.streams else None
        self._send = cfg.need_send_cache and (bool(whole_edges) or not cfg.streams)
        self._criteria = cfg.criteria if self._send else None
        self._sentinel = cfg.token_id
        groups = self.kv_cache_config.kv_cache_groups
        if cfg.need_send_cache and len(groups) != 1:
            raise OmniKVConfigError(
                f"OmniARScheduler: omni_kv_config.need_send_cache needs a model with one KV "
                f"cache group; this one has {len(groups)} (hybrid or sliding-window "
                "attention), whose blocks a transfer of group 0's block ids would not cover"
            )
        self._kv_block_size = groups[0].kv_cache_spec.block_size if groups else self.block_size
        # A request's blocks (of the one group), looked up once per marking: where vLLM's
        # get_blocks reads them, its one manager's req_to_blocks, with that dict's own get
        # (no Python frame per marking; a lookup must not add an entry to the defaultdict;
        # None for a request it does not know); in another layout, through get_blocks.
        req_to_blocks = _req_to_blocks(self.kv_cache_manager) if len(groups) == 1 else None
        self._group_blocks = (req_to_blocks.get if req_to_blocks is not None
                              else self._blocks_from_manager)
        # Our connector alone (not composed, its own request_finished) on KV cache managers
        # that free nothing early and keep no partial tails (full attention): vLLM's
        # preparation for a connector's request_finished (dropping out-of-window blocks,
        # finalizing mamba tails, the block ids clipped to the computed tokens) changes
        # nothing then, and our connector reads none of it. See _connector_finished.
        self._bare_finish = (
            self._send and self._omni is self.connector
            and not self._omni.loads_kv  # its request_finished ends a request's load
            and _reads_no_finish_blocks(self.connector)
            and _frees_nothing_early(self.kv_cache_manager)
        )
        # Our connector alone, keeping its own load-side hooks: a producer, it matches no
        # tokens, loads nothing, needs no word after an allocation, has no block frees to
        # wait for and reads no block state. vLLM's per-arrival and per-step connector work
        # in schedule() (the matching, a KVCacheBlocks per allocation, the set of the step's
        # scheduled ids for the block state) changes nothing for it then: schedule() runs
        # with the connector out of vLLM's sight, and the step's metadata is built after it,
        # as vLLM would (see _schedule_bare).
        self._bare_schedule = (
            self._omni is not None and self._omni is self.connector
            and not self._omni.loads_kv
            and _keeps_omni_hooks(self.connector, _LOAD_SIDE_HOOKS)
        )
        # Observers told at most every telemetry interval while transfers are in flight (see
        # the ledger's report_interval): their writes and spans then cost once per interval.
        self.transfer_ledger = TransferLedger(
            cfg.timeout_seconds, report_interval=cfg.telemetry_interval_seconds)
        for observer in build_observers(
            stage=cfg.stage_name,
            model_name=model_config.served_model_name or model_config.model,
            timeout_seconds=cfg.timeout_seconds,
            vllm_config=vllm_config,
        ):
            self.transfer_ledger.add_observer(observer)
        if cfg.need_send_cache:
            # vLLM's own switch for connectors whose hand-offs must be delivered (the base
            # connector's default for a producer, which the omni connector is; set here so
            # that no role in a kv-transfer-config can turn it off): a preempted request's
            # in-flight output is dropped, not delivered, and so is that of a request preempted
            # by reset_prefix_cache(reset_running_requests=True), which always drops.
            # Invariant this gives the triggers: vLLM keeps no output of a step that was in
            # flight when its request was preempted, so a request never samples, stops or
            # finishes while preempted (its KV freed), and every token vLLM keeps was
            # computed on the blocks the request holds when it is kept.
            self.requires_kv_delivery = True
        # Requests whose in-flight trigger has not fired yet (only with a criteria): taken in
        # when first scheduled (see _took_in), dropped when it fires or the request finishes.
        self._awaiting_trigger: set[str] = set()
        # Preempted requests whose unresolved transfer's blocks we keep out of the free pool
        # (one extra reference each) until it resolves: request id -> the pinned blocks.
        self._pinned: dict[str, list[Any]] = {}

    def _stream_producer(self, cfg: Any, model_config: Any) -> StreamProducer:
        if self._omni is None or not self._omni.sends_kv:
            raise OmniKVConfigError(
                "OmniARScheduler: omni_kv_config.streams needs the omni KV connector with "
                "the streamed stages among its endpoints")
        from omni_runtime.observability.stream_metrics import StreamMetrics

        metrics = StreamMetrics(cfg.stage_name,
                                model_config.served_model_name or model_config.model,
                                _default_registry(), to_stages=cfg.streams)
        # The figures on vLLM's connector-stats path too (a plain `vllm serve` shows them).
        observers: list[Any] = [metrics, self._omni.stream_stats()]
        from omni_runtime.observability.tracing import resolve_tracer

        tracer = resolve_tracer(self.vllm_config)
        if tracer is not None:
            from omni_runtime.observability.stream_tracing import StreamTracing

            observers.append(StreamTracing(tracer, stage=cfg.stage_name,
                                           model_name=model_config.served_model_name
                                           or model_config.model))
        # A step appends a request's sampled token and what it accepted of the tokens vLLM
        # scheduled beside it (drafts, or a diffusion model's canvas): vLLM's own bound.
        return StreamProducer(cfg.streams, self._omni.send_chunks, observers=observers,
                              refresh=metrics.refresh,
                              refresh_interval=cfg.telemetry_interval_seconds,
                              max_tokens_per_step=1 + self.num_spec_tokens)

    # ------------------------------------------------------------------ requests
    def _preempt_request(self, request: Request, timestamp: float, *args: Any, **kw: Any) -> None:
        if self._send:
            transfer = self.transfer_ledger.get(request.request_id)
            if transfer is not None and request.request_id not in self._pinned:
                # vLLM frees the preempted request's blocks below, and the same schedule()
                # may give them to another request. The transfer may still be handed off (or
                # its hand-off step still in flight): keep its blocks allocated, unchanged,
                # until it resolves.
                self._pin(transfer)
        super()._preempt_request(request, timestamp, *args, **kw)

    # ------------------------------------------------------------------ streaming-input sessions
    def add_request(self, request: Request) -> None:
        existing = self.requests.get(request.request_id) if self._streams is not None else None
        if (existing is not None and not request.resumable
                and existing.status == RequestStatus.WAITING_FOR_STREAMING_REQ):
            # A waiting session's input ended (vLLM's end of its stream of inputs): vLLM
            # finishes it as aborted, though it completed; its streams' last chunks go out.
            # (A client's abort comes through finish_requests, not here.)
            self._streams.input_ended(existing)
        super().add_request(request)

    def _update_request_as_session(self, session: Request, update: Any) -> None:
        if self._streams is not None:
            # vLLM folds the turn's output into the prompt and clears the list: what the turn
            # said is taken for the session's streams first.
            self._streams.turn_over(session)
        super()._update_request_as_session(session, update)

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        if self._streams is not None:
            self._streams.finished(request, request.status in _COMPLETED,
                                   f"the request ended {request.status.name.lower()}")
        if not self._send:
            return super()._free_request(request, delay_free_blocks)
        request_id = request.request_id
        ledger = self.transfer_ledger
        self._awaiting_trigger.discard(request_id)
        completed = request.status in _COMPLETED
        if completed and not ledger.has_triggered(request_id):
            # A completed request finished on an output vLLM kept, so it was running (see
            # requires_kv_delivery in __init__): its computed KV, less the tokens of steps
            # still in flight (async scheduling's placeholders), is what exists to ship.
            frontier = request.num_computed_tokens - request.num_output_placeholders
            self._mark(request, Trigger.REQUEST_FINISHED, frontier)
        transfer = ledger.get(request_id)
        pinned = self._pinned.get(request_id) if self._pinned else None
        if transfer is None and pinned is None:
            # Its transfer (if any) has resolved: nothing to hold, nothing pinned.
            ledger.finished_resolved(request_id)
        elif self._finish_unresolved(request_id, transfer, pinned, completed) and (
                not self._bare_finish):
            self._omni.hold_on_finish(request_id)  # the connector's answer to vLLM's path
        kv_params, ec_params = super()._free_request(request, delay_free_blocks)
        transfer = getattr(request, _TRANSFER_ATTR, None)
        if transfer is not None:
            params = _transfer_params(transfer)
            kv_params = {**kv_params, **params} if kv_params else params
        return kv_params, ec_params

    def _finish_unresolved(self, request_id: str, transfer: Transfer | None,
                           pinned: list[Any] | None, completed: bool) -> bool:
        """A finishing request whose transfer is unresolved (or whose blocks are pinned):
        hold its blocks until the transfer resolves, or cancel a pending one of an abort.
        Whether vLLM must delay the free of the request's blocks (the interface's delayed
        free: vLLM keeps them until we free them; not for pinned blocks, see _composed)."""
        ledger = self.transfer_ledger
        if pinned is None and self._composed and transfer is not None:
            pinned = self._pin(transfer)  # see _composed: vLLM frees the request itself
        if pinned is not None:
            num_blocks = len(pinned)  # its transfer's blocks are pinned, not the request's
        elif transfer is not None:
            num_blocks = sum(len(g) for g in self.kv_cache_manager.get_block_ids(request_id))
        else:
            num_blocks = 0
        hold = ledger.request_finished(request_id, num_blocks, aborted=not completed)
        if pinned is not None and ledger.get(request_id) is None:
            self._unpin(request_id)  # cancelled just now
        if not hold or self._omni is None:
            return False
        if transfer is not None and transfer.handed_off_at is not None:
            # Held on its edges (a pending one says so when it is handed off: HandOff.held).
            self._omni.held_on_finish(request_id, transfer.attempt, num_blocks,
                                      ledger.wall_time(transfer.held_since))
        return pinned is None

    def _connector_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        # See _bare_finish in __init__: vLLM's preparation would do nothing, and our
        # connector's answer (no parameters; delay the free while the request's transfer
        # holds its blocks) is read from the ledger straight away: _free_request has just
        # told it of the finish, so a transfer still unresolved now is held (its blocks are
        # the request's, unless pinned: see _finish_unresolved). With other connectors, or
        # KV cache managers that do free or finalize blocks at a finish, vLLM's own path,
        # which asks the connector (told by hold_on_finish).
        if self._bare_finish:
            request_id = request.request_id
            if self.transfer_ledger.get(request_id) is None or request_id in self._pinned:
                return _FREE_NOW
            return _DELAY_FREE
        return super()._connector_finished(request)

    # ------------------------------------------------------------------ the step
    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        ledger = self.transfer_ledger
        if self._streams is not None:
            self._streams.expire()
        # One observer batch per half step: the metrics write once per step, not per transfer.
        ledger.begin_batch()
        try:
            # Before scheduling, so that blocks freed by expiry serve this step (O(1) when
            # nothing is due: the oldest deadline's look).
            for transfer in ledger.expire_due():
                logger.warning(
                    "KV transfer of request %s expired: %s", transfer.request_id,
                    transfer.reason
                )
                self._withdraw(transfer)
                self._release(transfer)
            if self._bare_schedule:
                output = self._schedule_bare(*args, **kwargs)
            else:
                output = super().schedule(*args, **kwargs)
        finally:
            ledger.end_batch()
        if output.scheduled_new_reqs:
            self._took_in(output.scheduled_new_reqs)
        # The step goes to the model runner next: the observers' writes off the step (spans,
        # metric families) run while the engine waits for the forward pass.
        ledger.engine_waits()
        return output

    def _schedule_bare(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """vLLM's schedule() with the connector out of its sight (see _bare_schedule in
        __init__), then the step's connector metadata, which vLLM builds at its end. Nothing
        in vLLM's schedule() frees a request (which would ask the connector); the engine
        core calls its scheduler from one thread, its busy loop (its input thread only
        decodes requests), so nothing else reads the connector meanwhile; and the connector
        is back before the next call, an exception included."""
        connector = self.connector
        self.connector = None
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.connector = connector
        output.kv_connector_metadata = self._build_kv_connector_meta(connector, output)
        return output

    def _build_kv_connector_meta(self, connector: Any, scheduler_output: SchedulerOutput) -> Any:
        # Called inside schedule(), after its preemptions: a pending transfer of a request
        # preempted in this step has its blocks pinned, so handing it off is still exact.
        if self._send and self.transfer_ledger.num_pending:
            ledger = self.transfer_ledger
            wall = ledger.wall_time
            self._omni.hand_off([HandOff.of(t, wall) for t in ledger.hand_off_pending()])
        return super()._build_kv_connector_meta(connector, scheduler_output)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        streams = self._streams
        if streams is None:
            return self._update_transfers(scheduler_output, model_runner_output)
        connector_output = model_runner_output.kv_connector_output
        if connector_output is not None:
            answers = self._omni.take_chunk_answers(connector_output)
            if answers:
                streams.answered(answers)
        outputs = self._update_transfers(scheduler_output, model_runner_output)
        streams.stepped(scheduler_output.num_scheduled_tokens)
        return outputs

    def _update_transfers(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        if not self._send:
            return super().update_from_output(scheduler_output, model_runner_output)
        ledger = self.transfer_ledger
        ledger.begin_batch()  # see schedule()
        try:
            # The runner's answers concern transfers handed off in this or earlier steps:
            # resolve them first, so that a request finishing in this step sees its transfer
            # resolved and frees its blocks at once instead of holding them.
            connector_output = model_runner_output.kv_connector_output
            if connector_output is not None:
                answers = self._omni.take_answers(connector_output)
                if answers:
                    self._resolve_from_runner(answers)
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            # Requests that finished in this step were marked (request_finished) and dropped
            # from the set below by _free_request; what remains has not finished.
            if self._awaiting_trigger:
                if self._criteria is Trigger.PREFILL_FINISHED:
                    self._fire_prefill_finished(scheduler_output)
                else:
                    self._fire_special_token(outputs)
        finally:
            ledger.end_batch()
        return outputs

    def has_unfinished_requests(self) -> bool:
        # vLLM's has_requests() asks this too: the engine loop steps while a transfer is open.
        return (super().has_unfinished_requests() or self.transfer_ledger.has_unresolved()
                or (self._streams is not None and len(self._streams) > 0))

    def shutdown(self) -> None:
        # Resolve what is left, so that spans end, and give held blocks and their finished
        # requests back; then wait (bounded) until the observers have written out what they
        # were told: their reports are written off the step, by threads (writer_thread.py).
        self._fail_unresolved("scheduler shut down", lambda t: True)
        if self._streams is not None:
            self._streams.close("scheduler shut down")
        if not self.transfer_ledger.flush(timeout=_SHUTDOWN_FLUSH_SECONDS):
            logger.warning("KV transfer observers not done within %.0f s at shutdown",
                           _SHUTDOWN_FLUSH_SECONDS)
        super().shutdown()

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        # Held and pinned blocks are neither running nor free, so vLLM's reset would fail (and
        # raise with reset_running_requests). vLLM calls this for sleep mode and weight
        # updates: the transfers whose blocks stand in the way fail, with the reason.
        if self._send and (reset_running_requests or not self.running):
            running = {r.request_id for r in self.running} if reset_running_requests else set()
            self._fail_unresolved(
                "KV cache reset (sleep or weight update) while the transfer was in flight",
                lambda t: t.held or t.request_id in self._pinned or t.request_id in running,
            )
        return super().reset_prefix_cache(reset_running_requests, reset_connector)

    # ------------------------------------------------------------------ helpers
    def _fire_prefill_finished(self, scheduler_output: SchedulerOutput) -> None:
        """``prefill_finished``: fires on the request's state, not on an output's tokens (a
        prefill chunk samples none). Only requests scheduled in the step whose output this
        is can have reached the end of their prompt; the set intersection runs in C, the
        loop only over those candidates.

        On a stale output (its step was in flight when a preemption or a prefix-cache reset
        freed the request's KV; vLLM drops it): the preemption set num_computed_tokens to 0
        and counts only what was scheduled since, on the request's current blocks, so the
        test below fires only once the recompute has scheduled the whole prompt, and the
        snapshot names the blocks it is recomputed into (the hand-off reaches the workers in
        a later step, after the recompute's)."""
        requests = self.requests
        fired = []
        # A dict view & a set iterates the smaller of the two (in C): the requests still
        # awaiting their trigger, not the step's whole batch.
        for request_id in scheduler_output.num_scheduled_tokens.keys() & self._awaiting_trigger:
            request = requests[request_id]
            if request.num_computed_tokens >= request.num_prompt_tokens:
                fired.append(request)
        if fired:
            self._mark_many(Trigger.PREFILL_FINISHED, fired,
                            [request.num_prompt_tokens for request in fired])
            if not self._awaiting_trigger:
                # A set keeps the table a burst of arrivals grew until enough later inserts
                # rebuild it, and iterating it (the intersection above) walks the whole
                # table: emptied, it is cleared back to its small one.
                self._awaiting_trigger.clear()

    def _fire_special_token(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """``special_token``: fires on the tokens vLLM kept of this step, i.e. the new tokens
        of the step's outputs to its clients, never on the runner's raw samples. vLLM drops
        a stale output (its step was in flight when the request was preempted, in
        schedule() or by reset_prefix_cache, or when a session's turn ended) whatever the
        request's state when it arrives, RUNNING again included, and trims the tokens after
        a stop. One C-level containment test per output; the rest only for outputs holding
        the sentinel."""
        sentinel = self._sentinel
        awaiting = self._awaiting_trigger
        requests = self.requests
        fired: list[Request] = []
        cuts: list[int] = []
        for client_outputs in outputs.values():
            for output in client_outputs.outputs:
                if sentinel in output.new_token_ids and output.request_id in awaiting:
                    request = requests[output.request_id]
                    new_tokens = output.new_token_ids
                    # The kept tokens end at vLLM's materialized frontier (computed tokens
                    # less those of steps in flight): the last one sits there, its own KV
                    # not computed yet. Cut before the first sentinel. (Not from num_tokens:
                    # a streaming session whose turn ended in this step may already have
                    # taken in its next input, after the frontier.)
                    frontier = request.num_computed_tokens - request.num_output_placeholders
                    before = frontier + 1 - len(new_tokens) + list(new_tokens).index(sentinel)
                    awaiting.discard(output.request_id)  # its trigger has fired
                    fired.append(request)
                    cuts.append(before)
        if fired:
            self._mark_many(Trigger.SPECIAL_TOKEN, fired, cuts)

    def _mark(self, request: Request, trigger: Trigger, seq_len: int) -> Transfer:
        """Marks the request's one transfer (see :meth:`_mark_many`)."""
        return self._mark_many(trigger, [request], [seq_len])[0]

    def _mark_many(self, trigger: Trigger, requests: list[Request],
                   seq_lens: list[int]) -> list[Transfer]:
        """Marks each request's one transfer: its first ``seq_len`` tokens, on the blocks it
        holds now (the step's triggers together: one ledger call). Callers mark only on
        what vLLM kept, for a request that is not preempted (see requires_kv_delivery in
        __init__), so that the blocks hold the KV; a lookup that fails or finds too few
        blocks fails the transfer with the reason instead of shipping blocks that do not
        hold the snapshot."""
        awaiting = self._awaiting_trigger
        block_size = self._kv_block_size
        group_blocks = self._group_blocks
        marks = []
        failed: dict[str, str] = {}  # request id -> why its marking failed
        for request, seq_len in zip(requests, seq_lens):
            request_id = request.request_id
            awaiting.discard(request_id)
            try:
                blocks = group_blocks(request_id) or ()
                needed = -(-seq_len // block_size)
                if len(blocks) < needed:
                    raise RuntimeError(
                        f"request holds {len(blocks)} KV blocks, {needed} needed for "
                        f"seq_len {seq_len}"
                    )
                # A tuple: immutable, as the hand-off needs it (HandOff.of's tuple() is then
                # the same object, no copy per transfer).
                block_ids = tuple(map(_BLOCK_ID, blocks[:needed]))
            except Exception as exc:  # reported: the transfer resolves as failed, below
                block_ids = ()
                failed[request_id] = f"marking failed: {type(exc).__name__}: {exc}"
            marks.append((request_id, seq_len, block_ids, request.trace_headers))
        ledger = self.transfer_ledger
        if not failed:
            transfers = ledger.mark_many(trigger, marks)
            for request, transfer, seq_len in zip(requests, transfers, seq_lens):
                setattr(request, _TRANSFER_ATTR, transfer)
                transfer.carried = _carried(request, trigger, seq_len)
            return transfers
        # A lookup failed (rare): one mark at a time, each failure resolved right after its
        # mark, so that the ledger changes (and its observers see it change) as with one
        # trigger at a time.
        transfers = []
        for request, mark in zip(requests, marks):
            (transfer,) = ledger.mark_many(trigger, [mark])
            setattr(request, _TRANSFER_ATTR, transfer)
            transfer.carried = _carried(request, trigger, mark[1])
            transfers.append(transfer)
            error = failed.get(mark[0])
            if error is not None:
                logger.error("KV transfer of request %s failed: %s", mark[0], error)
                ledger.resolve(mark[0], Outcome.FAILED, error)
        return transfers

    def _blocks_from_manager(self, request_id: str) -> list[Any]:
        """The request's KV blocks (of its one KV cache group) through vLLM's get_blocks:
        the lookup where the coordinator is not laid out as :func:`_req_to_blocks` reads it
        (see ``_group_blocks`` in ``__init__``)."""
        return self.kv_cache_manager.get_blocks(request_id).blocks[0]

    def _resolve_from_runner(self, answers: dict[str, Answer]) -> None:
        """The workers' answers, each naming the attempt it answers: one about an earlier
        attempt (or a transfer already resolved) resolves nothing (the ledger's
        resolve_answers, which resolves each as the loop reaches it: its blocks are given
        back before the next resolves). The connector records those that resolved, where
        the engine collects stats (vLLM's log_stats)."""
        # The answers that resolved nothing, kept only for the stats' filter below: none
        # without stats, where the connector records nothing (see stop_stats in __init__).
        ignored: list[str] | None = [] if self.log_stats else None
        for transfer in self.transfer_ledger.resolve_answers(answers, ignored):
            if transfer.reason is not None:
                logger.warning("KV transfer of request %s %s: %s", transfer.request_id,
                               transfer.outcome.value, transfer.reason)
            if transfer.held_since is not None or self._pinned:
                self._release(transfer)  # else nothing to give back: still running, no pin
        if ignored is None:
            return
        if ignored:
            ignored_ids = set(ignored)
            answers = {rid: a for rid, a in answers.items() if rid not in ignored_ids}
        self._omni.record_answers(answers)

    def _fail_unresolved(self, reason: str, which: Any) -> None:
        for transfer in self.transfer_ledger.unresolved():
            if which(transfer):
                self.transfer_ledger.resolve(transfer.request_id, Outcome.FAILED, reason)
                self._withdraw(transfer)
                self._release(transfer)

    def _withdraw(self, transfer: Transfer) -> None:
        """A handed-off transfer resolved here, not by a worker's answer: its blocks may be
        re-used from the next step on, so the workers must refuse to commit a receiver's read
        of it from then on (the block guarantee at a distance, kv/worker_side.py)."""
        if transfer.handed_off_at is not None:
            self._omni.withdraw(transfer.request_id, transfer.attempt, transfer.outcome.value,
                                transfer.resolved_at - transfer.handed_off_at)

    def _release(self, transfer: Transfer) -> None:
        """Give back the blocks a transfer that has just resolved kept (exactly once: the
        ledger returns a transfer from resolve only once): its pinned blocks, and a finished
        request's held blocks (then vLLM forgets the request)."""
        if self._unpin(transfer.request_id) or not transfer.held:
            return  # pinned: vLLM freed (or frees) the request's own blocks itself
        request = self.requests.get(transfer.request_id)
        if request is not None and request.is_finished():
            self._free_blocks(request)

    def _pin(self, transfer: Transfer) -> list[Any]:
        """One extra reference on each of the transfer's blocks: out of the free pool until
        :meth:`_unpin`, whatever vLLM does with the request's own."""
        pool = self.kv_cache_manager.block_pool
        blocks = [pool.blocks[i] for i in transfer.block_ids]
        pool.touch(blocks)
        self._pinned[transfer.request_id] = blocks
        return blocks

    def _unpin(self, request_id: str) -> bool:
        """Drop the transfer's pin, if it had one (then True)."""
        blocks = self._pinned.pop(request_id, None)
        if blocks is None:
            return False
        self.kv_cache_manager.block_pool.free_blocks(blocks)
        return True

    def _took_in(self, new_requests: list[NewRequestData]) -> None:
        """The requests vLLM sends the workers whole in this step: those scheduled for the
        first time, a streaming session's next turn, and (with vLLM's v2 model runner) those
        resumed after a preemption. Those that have not started their transfer await their
        trigger from now on (a request samples only once scheduled; a set difference in C:
        a turn or a resumption re-arms nothing). Those that carry vllm-omni's
        additional_information (none on plain vLLM) pass it on to the workers."""
        ids = list(map(_REQ_ID, new_requests))
        if self._streams is not None:
            self._streams.started(map(self.requests.__getitem__, ids))
        if self._criteria is not None:
            self._awaiting_trigger |= self.transfer_ledger.not_triggered(ids)
        # Each request's payload or None, read in C: no Python loop per arrival on a stage
        # (plain vLLM) whose requests carry none.
        payloads = list(map(getattr, map(self.requests.__getitem__, ids),
                            repeat(_PAYLOAD_ATTR), repeat(None)))
        if payloads.count(None) != len(payloads):
            for new_request, information in zip(new_requests, payloads):
                if information is not None:
                    new_request.__class__ = OmniNewRequestData
                    new_request.additional_information = information


def _req_to_blocks(kv_cache_manager: Any) -> dict[str, list[Any]] | None:
    """The per-request block lists vLLM's ``KVCacheCoordinator.get_blocks`` reads for a
    model of one KV cache group (its one manager's ``req_to_blocks``, made once with the
    manager), or None where the coordinator is not laid out so."""
    managers = getattr(getattr(kv_cache_manager, "coordinator", None), "single_type_managers",
                       None)
    if not isinstance(managers, tuple) or len(managers) != 1:
        return None
    req_to_blocks = getattr(managers[0], "req_to_blocks", None)
    return req_to_blocks if isinstance(req_to_blocks, dict) else None


def _frees_nothing_early(kv_cache_manager: Any) -> bool:
    """Whether every KV cache manager keeps vLLM's defaults for what a finish prepares for a
    connector (no skipped blocks to drop, no partial tail to finalize): full attention's."""
    managers = getattr(getattr(kv_cache_manager, "coordinator", None), "single_type_managers",
                       None)
    if not managers:
        return False
    base = SingleTypeKVCacheManager
    return all(
        type(m).get_num_skipped_tokens is base.get_num_skipped_tokens
        and type(m).remove_skipped_blocks is base.remove_skipped_blocks
        and type(m).finalize_partial_tail_offload is base.finalize_partial_tail_offload
        for m in managers
    )


#: The hooks vLLM's schedule() calls on a KV connector (the load side, and the step's
#: metadata, which a connector may build from the block state vLLM gathers for it).
_LOAD_SIDE_HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources", "has_pending_block_frees",
    "supports_divergent_local_hybrid_hits", "build_connector_meta",
)


def _keeps_omni_hooks(connector: Any, names: tuple[str, ...]) -> bool:
    """Whether ``connector`` is the omni connector with these attributes its own (none a
    subclass's override): what the scheduler's shortcuts past vLLM's connector calls rely
    on."""
    for cls in type(connector).__mro__:
        if "omni_kv_connector" in vars(cls):  # the omni connector's class (see its marker)
            return all(getattr(type(connector), name) is getattr(cls, name) for name in names)
    return False


def _reads_no_finish_blocks(connector: Any) -> bool:
    """Whether vLLM would call the omni connector's own request_finished (it reads neither
    the block ids nor anything vLLM prepares for it): not a subclass's override, nor a
    connector of the hybrid allocator (vLLM calls its request_finished_all_groups)."""
    return (not isinstance(connector, SupportsHMA)
            and _keeps_omni_hooks(connector, ("request_finished",)))


def _find_omni_connector(connector: Any) -> Any:
    """The omni KV connector among the scheduler's (itself, or a MultiConnector's child)."""
    for candidate in (connector, *(getattr(connector, "_connectors", None) or ())):
        if getattr(candidate, "omni_kv_connector", False):
            return candidate
    return None


def _carried(request: Request, trigger: Trigger, seq_len: int) -> Carried:
    """What the request's transfer carries besides its KV (sched/handoff.py's Carried): its
    tokens at the trigger (every one it has at its finish, else the ``seq_len`` the KV
    covers) and its pipeline context (``kv_transfer_params["omni"]``, set by the pipeline's
    endpoint, or by the stage that made the request from a hand-off)."""
    tokens = request.all_token_ids
    n = len(tokens) if trigger is Trigger.REQUEST_FINISHED else seq_len
    params = request.kv_transfer_params
    origin = params.get(KV_PARAMS_KEY) if params else None
    return Carried(tokens[:n], min(request.num_prompt_tokens, n),
                   origin if isinstance(origin, dict) else None)


def _transfer_params(transfer: Transfer) -> dict[str, Any]:
    """What the request's output carries about its transfer (as the reference does, plus
    its state: the outcome if it resolved before the request finished)."""
    block_ids = list(transfer.block_ids)
    outcome = transfer.outcome
    return {
        "past_key_values": block_ids,
        "kv_metadata": {
            "seq_len": transfer.seq_len,
            "block_ids": block_ids,
            "trigger": VALUES[transfer.trigger],
            "state": VALUES[transfer.phase],
            "outcome": None if outcome is None else VALUES[outcome],
            "reason": transfer.reason,
        },
    }


class OmniARScheduler(OmniKVTransferMixin, Scheduler):
    """The omni AR scheduler. ``--scheduler-cls omni_runtime.sched.OmniARScheduler``
    gives :class:`OmniARAsyncScheduler` when vLLM runs with async scheduling (its default on
    GPUs): vLLM picks its own AsyncScheduler only when no scheduler class is given, and a
    synchronous scheduler under an async engine would lose the overlap."""

    def __new__(cls, *args: Any, **kwargs: Any) -> OmniARScheduler:
        if cls is OmniARScheduler:
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            if getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False):
                cls = OmniARAsyncScheduler
        return super().__new__(cls)


class OmniARAsyncScheduler(OmniARScheduler, AsyncScheduler):
    """The omni AR scheduler over vLLM's AsyncScheduler."""


def _default_registry() -> Any:
    from prometheus_client import REGISTRY

    return REGISTRY
