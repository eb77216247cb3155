"""``make demo``: the omni AR scheduler in a real vLLM engine on the tiny CPU model.

Generates for a few prompts with ``prefill_finished`` KV transfers on, and prints every
transfer's life as the ledger sees it, then per-request tokens and outcomes. The next stage
it sends to is an address where nothing listens (a stage that is gone), so every transfer
fails or expires at its deadline, and the held blocks go back to the pool: the behaviour
that keeps a stage healthy when its receiver is gone.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-seconds", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from vllm import SamplingParams

    from omni_runtime.devtools.offline import drain_transfers, engine_core_of, omni_llm
    from omni_runtime.devtools.tiny_model import ensure_tiny_model
    from omni_runtime.transfers.ledger import TransferObserver

    model = ensure_tiny_model()
    print(f"tiny model: {model}")
    with socket.socket() as probe:  # a port nothing listens on: the next stage is gone
        probe.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{probe.getsockname()[1]}"
    print(f"the next stage (nothing listens there): {gone}")
    llm = omni_llm(
        str(model),
        {
            "need_send_cache": True,
            "kv_transfer_criteria": {"type": "prefill_finished"},
            "timeout_seconds": args.timeout_seconds,
        },
        endpoints={"next": gone},
        kv_cache_memory_bytes=64 << 20,
        max_model_len=512,
        dtype="float32",
        enforce_eager=True,
    )
    scheduler = engine_core_of(llm).scheduler
    start = time.monotonic()

    class Print(TransferObserver):
        def _say(self, what, t, extra=""):
            print(f"  {time.monotonic() - start:6.2f}s  {t.request_id:<14} {what:<11} {extra}")

        def on_marked(self, ledger, t):
            self._say("marked", t, f"trigger={t.trigger.value} seq_len={t.seq_len} blocks={list(t.block_ids)}")

        def on_handed_off(self, ledger, t):
            self._say("handed off", t)

        def on_held(self, ledger, t):
            self._say("held", t, f"{t.held_blocks} blocks kept for the transfer")

        def on_resolved(self, ledger, t):
            self._say(t.outcome.value, t, t.reason or "")

    scheduler.transfer_ledger.add_observer(Print())
    free_at_start = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    prompts = ["Hello world", "The quick brown fox jumps over", "An omni pipeline runs stages"]
    print("\ntransfer events:")
    outputs = llm.generate(
        prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False
    )
    print(f"  (generation done; {scheduler.transfer_ledger})")
    drain_transfers(llm, timeout_s=args.timeout_seconds + 30)

    print("\nrequests:")
    for out in outputs:
        meta = (out.kv_transfer_params or {}).get("kv_metadata", {})
        print(f"  {out.prompt!r:<34} tokens={list(out.outputs[0].token_ids)}")
        print(f"  {'':<34} kv: trigger={meta.get('trigger')} seq_len={meta.get('seq_len')} "
              f"state at finish={meta.get('state')}")
    free_now = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    print(f"\nfree KV blocks: {free_at_start} before, {free_now} after: "
          f"{'none leaked' if free_now == free_at_start else 'LEAKED'}")
    llm.llm_engine.engine_core.shutdown()
    return 0 if free_now == free_at_start else 1


if __name__ == "__main__":
    sys.exit(main())
