"""Prefill-to-decode hand-off through the shared remote tier (issue 11): disaggregation.

Starts a Mooncake master, then two processes, each with its own local tiers (HBM on the
CPU device here, DRAM, NVMe) and its own Mooncake client:

* **prefill** runs a tiny random-weight Llama (``transformers``' ``LlamaConfig``, seeded:
  no weights are downloaded) over a long prompt, stores the prompt's KV blocks with
  ``put_tokens`` (published to the remote tier at once: ``remote_write=through``) and waits.
  It stores them under ``--repeats + 1`` namespaces (the published figures are the first's),
  so that every hand-off the decode process times is a real remote fetch, never a local hit;
* **decode** builds the same model (same seed, same weights) and hands off: finds the
  prompt's KV by prefix (``match_prefix``: one batched existence check), reads it
  (``get_prefix``: remote -> HBM), rebuilds the model's KV cache from the blocks
  (``from_blocks``), runs only the uncached tail and decodes. It also recomputes the whole
  prefill, and checks that every hand-off gives the same tokens as every recompute, and that
  the KV every hand-off fetched is, bit for bit, the prompt's KV computed once in the decode
  process (untimed, ``prompt_kv``): the tokens alone cannot tell the prompt's blocks handed
  back in another order (keys are cached after RoPE, so attention ignores their order).

Time to first token: each path runs once untimed (warm-up), then hand-off and recompute
alternate ``--repeats`` times (5), the one that goes first swapping each time. The hand-off's
TTFT is fetch + rebuild + tail forward; the figures are medians, and the speed-up is the
median over pairs of recompute TTFT / hand-off TTFT (a pair ran right next to each other).
If any run of either path decodes other tokens, or any hand-off fetched other KV, or fewer
blocks than the prompt's whole blocks (a hand-off that found nothing to fetch, because the
prefill process or the master died, is a recompute), the hand-off did not hand off the
prompt's KV: no TTFT or speed-up is printed, no JSON written, and the demo exits 1. A
process that fails ends the demo with its own error; SIGTERM and Ctrl-C stop both processes
and the master, and each process removes its NVMe folder.
Also prints the bytes moved by one hand-off. Needs the ``remote`` and ``hf`` extras.

Usage: ``python scripts/disagg_demo.py [--tokens 2048] [--new-tokens 8] [--repeats 5] [--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch

from tiercache.bench.rounds import alternate, positive_int
from tiercache.bench.script_args import ScriptParser, refuse_bad_outputs, seed_int
from tiercache.config import KVLayout, RemoteConfig, TierConfig
from tiercache.data.remote_master import start_master
from tiercache.errors import UserError
from tiercache.keys import prefix_keys
from tiercache.live.store import TieredKVStore
from tiercache.results.outfile import replace_file

BLOCK_TOKENS, NAMESPACE = 64, "disagg-demo"
#: The tiny model's longest sequence (``max_position_embeddings``): prompt and new tokens.
MAX_POSITIONS = 16384
#: Longest wait for the decode process (its runs, every repeat) and for the prefill's results.
DECODE_TIMEOUT_S, PREFILL_TIMEOUT_S = 600, 300
#: Largest ``|fetched KV - the prompt's KV recomputed by the decode process|`` accepted: 0, bit
#: for bit. Both processes run the same seeded model on the same prompt with the same CPU
#: kernels, and the store keeps the fp32 KV as it is (no codec), so any difference is KV that
#: is not the prompt's as stored: its blocks in another order, another prompt's, damaged bytes.
KV_TOLERANCE = 0.0
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renames past_key_values in 5.x


def build_model(seed: int):
    """A tiny Llama with random weights (the same in both processes: seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=MAX_POSITIONS)
    return LlamaForCausalLM(config).eval()


def layout_of(model) -> KVLayout:
    c = model.config
    return KVLayout(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, "float32", BLOCK_TOKENS)


def open_store(model, master: str, metadata: str, blocks: int, folder: str) -> TieredKVStore:
    """Local tiers (HBM on the CPU device here, DRAM, NVMe in ``folder``, which the caller
    removes) plus the shared remote tier, for ``blocks`` blocks in all (every copy of the
    prompt): HBM and the remote tier hold them all, so no timed fetch pays a local demotion
    or a remote eviction."""
    layout = layout_of(model)
    segment = max(256 << 20, 2 * blocks * layout.block_bytes)
    remote = RemoteConfig(master, metadata, segment_bytes=segment, buffer_bytes=64 << 20)
    tiers = [TierConfig("hbm", max(64, blocks)), TierConfig("dram", 64), TierConfig("nvme", 256),
             TierConfig("remote", max(4096, blocks), remote=remote)]
    return TieredKVStore(layout, tiers, path=folder, device="cpu")


def namespace_of(copy: int) -> str:
    """The namespace of copy ``copy`` of the prompt's KV (0: the warm-up hand-off's)."""
    return f"{NAMESPACE}-{copy}"


def prompt_ids(tokens: int, seed: int) -> list[int]:
    return torch.randint(0, 2000, (tokens,), generator=torch.Generator().manual_seed(seed + 1)).tolist()


def kv_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(keys, values)`` per layer, each ``[1, kv_heads, tokens, head_dim]``."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def to_blocks(cache, n_blocks: int) -> torch.Tensor:
    """The first ``n_blocks`` blocks of a model cache as ``[n, layers, 2, kv_heads, bt, hd]``."""
    layers = [torch.stack((k[0], v[0])) for k, v in kv_layers(cache)]  # [2, kv_heads, T, hd] each
    kv = torch.stack(layers)[:, :, :, : n_blocks * BLOCK_TOKENS]  # [layers, 2, kv_heads, T', hd]
    kv = kv.unflatten(3, (n_blocks, BLOCK_TOKENS))  # [layers, 2, kv_heads, n, bt, hd]
    return kv.permute(3, 0, 1, 2, 4, 5).contiguous()


def from_blocks(blocks: torch.Tensor, model):
    """A ``DynamicCache`` holding the tokens of ``blocks`` (inverse of ``to_blocks``)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers before the per-layer caches
        cache = DynamicCache()
    kv = blocks.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # [layers, 2, kv_heads, T, hd]
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0].unsqueeze(0).contiguous(), kv[layer, 1].unsqueeze(0).contiguous(), layer)
    return cache


@torch.no_grad()
def greedy(model, ids: list[int], cache, new_tokens: int) -> tuple[list[int], float]:
    """Runs ``ids`` after ``cache`` (None: from scratch) and decodes greedily; returns the
    tokens and the seconds to the first one."""
    start = time.perf_counter()
    out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    first = time.perf_counter() - start
    cache = out.past_key_values
    for _ in range(new_tokens - 1):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
        cache = out.past_key_values
    return tokens, first


@torch.no_grad()
def prompt_kv(model, ids: list[int]) -> torch.Tensor:
    """The prompt's whole blocks of KV, ``[n, layers, 2, kv_heads, bt, hd]``, computed in this
    process (untimed): what a hand-off must fetch, bit for bit."""
    out = model(torch.tensor([ids]), use_cache=True)
    return to_blocks(out.past_key_values, len(ids) // BLOCK_TOKENS)


def kv_difference(fetched: torch.Tensor, reference: torch.Tensor) -> float:
    """``max |fetched - reference[:len(fetched)]|``: 0.0 when every fetched block is bit for
    bit the reference's block at its position (and when nothing was fetched); infinity when
    the blocks do not even have the reference's shape, or are more than it holds."""
    if fetched.shape[1:] != reference.shape[1:] or fetched.shape[0] > reference.shape[0]:
        return float("inf")
    if fetched.shape[0] == 0:
        return 0.0
    return float((fetched - reference[: fetched.shape[0]]).abs().max())


@torch.no_grad()
def prefill(args) -> None:
    """Prefills the prompt and publishes its KV once per namespace (``args.repeats + 1``);
    prints the prefill's and the first publication's figures as one JSON line."""
    model = build_model(args.seed)
    ids = prompt_ids(args.tokens, args.seed)
    start = time.perf_counter()
    out = model(torch.tensor([ids]), use_cache=True)
    seconds = time.perf_counter() - start
    n_blocks, copies = len(ids) // BLOCK_TOKENS, args.repeats + 1
    blocks = to_blocks(out.past_key_values, n_blocks)
    with tempfile.TemporaryDirectory(prefix="tiercache-disagg-") as folder, \
            open_store(model, args.master, args.metadata, copies * n_blocks, folder) as store:
        start = time.perf_counter()
        stored = store.put_tokens(ids[: n_blocks * BLOCK_TOKENS], blocks, namespace=namespace_of(0))
        store.wait()  # the remote puts run in the background
        store_seconds = time.perf_counter() - start
        published = store.stats()["remote"]["puts"]
        for copy in range(1, copies):  # the same KV under other keys, for the repeated hand-offs (not timed)
            store.put_tokens(ids[: n_blocks * BLOCK_TOKENS], blocks, namespace=namespace_of(copy))
        store.wait()
        print(json.dumps({"prefill_s": seconds, "store_s": store_seconds, "blocks": stored, "published": published,
                          "bytes_put": published * store.layout.block_bytes, "copies": copies,
                          "published_all": store.stats()["remote"]["puts"]}), flush=True)
        sys.stdin.readline()  # this client's segment holds the values: stay until decode is done


def handoff(store: TieredKVStore, model, ids: list[int], namespace: str, new_tokens: int,
            reference: torch.Tensor) -> dict:
    """One hand-off: finds the prompt's KV by prefix, fetches it, rebuilds the model cache
    (``from_blocks``), runs the uncached tail and decodes ``new_tokens`` tokens; then, after
    the clock, compares the fetched blocks with ``reference`` (``prompt_kv``).

    Returns:
        ``found_tokens``, ``cached_tokens``, ``tokens``, the seconds ``fetch_s``,
        ``rebuild_s`` and ``tail_s``, and ``ttft_s``: their sum, everything from the prefix
        lookup to the first token. Also this hand-off's ``bytes_fetched``, ``remote_gets``
        and ``exists_calls`` (differences of the store's counters), and ``kv_max_abs_diff``
        (``kv_difference`` of the fetched blocks from ``reference``).
    """
    before = store.stats()
    start = time.perf_counter()
    found = store.match_prefix(ids, namespace=namespace)
    cached = min(found, len(ids) - 1)  # the last prompt token always runs: it yields the first logits
    blocks = store.get_prefix(prefix_keys(ids, BLOCK_TOKENS, namespace)[: cached // BLOCK_TOKENS])
    cached = len(blocks) * BLOCK_TOKENS
    fetched = time.perf_counter()
    cache = from_blocks(blocks, model) if cached else None
    rebuild = time.perf_counter() - fetched
    tokens, tail = greedy(model, ids[cached:], cache, new_tokens)
    after = store.stats()
    moved = after["bytes_moved"].get("remote->hbm", 0) - before["bytes_moved"].get("remote->hbm", 0)
    return {"found_tokens": found, "cached_tokens": cached, "tokens": tokens, "fetch_s": fetched - start,
            "rebuild_s": rebuild, "tail_s": tail, "ttft_s": fetched - start + rebuild + tail, "bytes_fetched": moved,
            "remote_gets": after["remote"]["gets"] - before["remote"]["gets"],
            "exists_calls": after["remote"]["exists_calls"] - before["remote"]["exists_calls"],
            "kv_max_abs_diff": kv_difference(blocks, reference)}


def recompute(model, ids: list[int], new_tokens: int) -> dict:
    """The whole prefill from scratch, then ``new_tokens`` tokens: ``tokens`` and ``ttft_s``."""
    tokens, first = greedy(model, ids, None, new_tokens)
    return {"tokens": tokens, "ttft_s": first}


def handed_off_blocks(tokens: int) -> int:
    """Blocks a hand-off of a ``tokens``-token prompt fetches: its whole blocks before the last
    token (which always runs, to give the first logits)."""
    return (tokens - 1) // BLOCK_TOKENS


def summarise(handoffs: list[dict], recomputes: list[dict], expected_blocks: int) -> dict:
    """Medians of the hand-off's parts and of both TTFTs, and the median over pairs of
    recompute TTFT / hand-off TTFT (``ttft_speedup``); ``same_tokens`` is whether every run of
    either path decoded the same tokens, ``same_kv`` whether every hand-off fetched the
    prompt's KV within ``KV_TOLERANCE`` (``kv_max_abs_diff``: the largest difference of any),
    and ``ttft_speedup`` is None unless both hold (a hand-off that fetched other KV, even one
    that decodes the same tokens, as blocks in another order do, did not hand off the
    prompt's KV: its time means nothing), nor unless ``fetched_all``: every hand-off fetched
    from the remote tier all ``expected_blocks`` of the prompt's blocks it can use (one that
    found fewer, its publisher or the master gone, recomputed them). ``tokens`` are the first hand-off's,
    ``recompute_tokens`` the first recompute's. The fetch counters are one hand-off's (the first)."""
    def median(runs: list[dict], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    runs = handoffs + recomputes
    first = handoffs[0]
    same = all(run["tokens"] == first["tokens"] for run in runs)
    kv_error = max(run["kv_max_abs_diff"] for run in handoffs)
    same_kv = kv_error <= KV_TOLERANCE
    fetched_all = all(run["cached_tokens"] == expected_blocks * BLOCK_TOKENS and run["remote_gets"] == expected_blocks
                      for run in handoffs)
    return {"expected_blocks": expected_blocks, "fetched_all": fetched_all,
            "fewest_fetched": min(run["remote_gets"] for run in handoffs),"found_tokens": first["found_tokens"], "cached_tokens": first["cached_tokens"], "repeats": len(handoffs),
            "fetch_s": median(handoffs, "fetch_s"), "rebuild_s": median(handoffs, "rebuild_s"), "tail_s": median(handoffs, "tail_s"),
            "ttft_handoff_s": median(handoffs, "ttft_s"), "ttft_recompute_s": median(recomputes, "ttft_s"),
            "ttft_speedup": statistics.median(r["ttft_s"] / h["ttft_s"] for h, r in zip(handoffs, recomputes, strict=True))
            if same and same_kv and fetched_all else None,
            "same_tokens": same, "same_kv": same_kv, "kv_max_abs_diff": kv_error,
            "tokens": first["tokens"], "recompute_tokens": recomputes[0]["tokens"],
            "bytes_fetched": first["bytes_fetched"], "remote_gets": first["remote_gets"], "exists_calls": first["exists_calls"],
            "samples": {"handoff": [{k: v for k, v in h.items() if k != "tokens"} for h in handoffs],
                        "recompute_ttft_s": [r["ttft_s"] for r in recomputes]}}


def decode(args) -> None:
    """Hands off and recomputes, alternating (``alternate``), every hand-off checked against
    the prompt's KV computed here once, untimed (``prompt_kv``); prints ``summarise``'s JSON."""
    model = build_model(args.seed)
    ids = prompt_ids(args.tokens, args.seed)
    reference = prompt_kv(model, ids)
    blocks = (args.repeats + 1) * (len(ids) // BLOCK_TOKENS)
    with tempfile.TemporaryDirectory(prefix="tiercache-disagg-") as folder, \
            open_store(model, args.master, args.metadata, blocks, folder) as store:
        runs = alternate({"handoff": lambda i: handoff(store, model, ids, namespace_of(i), args.new_tokens, reference),
                          "recompute": lambda _: recompute(model, ids, args.new_tokens)}, args.repeats)
    handoffs, recomputes = runs["handoff"], runs["recompute"]
    print(json.dumps(summarise(handoffs, recomputes, handed_off_blocks(len(ids)))), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=positive_int, default=2048,
                        help=f"prompt length (default 2048; more than one {BLOCK_TOKENS}-token block)")
    parser.add_argument("--new-tokens", type=positive_int, default=8, help="tokens to decode (default 8)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed hand-off/recompute pairs, after one untimed of each (medians; default 5)")
    parser.add_argument("--seed", type=seed_int, default=0, help="seed of the weights and the prompt (default 0)")
    parser.add_argument("--json", help="write both processes' results here")
    parser.add_argument("--role", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--metadata", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokens <= BLOCK_TOKENS:
        parser.error(f"--tokens: more than one {BLOCK_TOKENS}-token block (a whole block to hand off), got {args.tokens}")
    if args.tokens + args.new_tokens > MAX_POSITIONS:
        parser.error(f"--tokens {args.tokens} with --new-tokens {args.new_tokens}: the model holds {MAX_POSITIONS} positions")
    refuse_bad_outputs(parser, {"--json": args.json})  # before the run, not after it
    signal.signal(signal.SIGTERM, _exit_once)  # the cleanup runs, as for Ctrl-C: no process outlives the demo, no folder stays
    if args.role == "prefill":
        prefill(args)
        return 0
    if args.role == "decode":
        decode(args)
        return 0
    try:
        return run_demo(args)
    except KeyboardInterrupt:
        print("disagg_demo: interrupted", file=sys.stderr)
        return 130


def _exit_once(signum: int, frame) -> None:
    """SIGTERM: exits 143 through every ``finally`` (stores closed, folders removed, children
    stopped), ignoring further ones meanwhile: a group's SIGTERM reaches a child and then its
    parent's own (``_end``), which must not cut the first one's cleanup short."""
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def run_demo(args) -> int:
    """The parent: a master, the prefill process, then the decode process. Whatever ends it
    (a process that failed, SIGTERM, Ctrl-C) stops both processes and the master first."""
    master = start_master()
    common = ["--tokens", str(args.tokens), "--new-tokens", str(args.new_tokens), "--seed", str(args.seed), "--repeats", str(args.repeats),
              "--master", master.master, "--metadata", master.metadata]
    prefill_process = None
    with tempfile.TemporaryFile("w+") as prefill_errors:
        try:
            prefill_process = subprocess.Popen([sys.executable, __file__, "--role", "prefill", *common], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=prefill_errors, text=True)
            produced = _prefill_result(prefill_process, prefill_errors)
            consumed = _decode_result(common)
        finally:
            _stop(prefill_process)
            master.stop()
    return report(produced, consumed, args)


def _prefill_result(process: subprocess.Popen, errors) -> dict:
    """The prefill process's JSON line, once it published the prompt's KV.

    Raises:
        SystemExit: it ended (or printed something else) first, with its error output.
    """
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(PREFILL_TIMEOUT_S)  # a whole line, or none: a partial line then a hang is waited for no longer
    if not lines:
        raise SystemExit(f"disagg_demo: the prefill process published nothing within {PREFILL_TIMEOUT_S} s")
    line = lines[0]
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        try:
            process.wait(PREFILL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        errors.seek(0)
        raise SystemExit(f"disagg_demo: the prefill process failed ({_status(process.poll())}):\n"
                         f"{(line + errors.read())[-3000:]}") from None


def _decode_result(common: list[str]) -> dict:
    """The decode process's summary (``summarise``). Whatever interrupts the wait (SIGTERM,
    Ctrl-C, the timeout) sends it SIGTERM first, so it closes its store and removes its
    folder (``_end``).

    Raises:
        SystemExit: it failed or ran past ``DECODE_TIMEOUT_S``.
    """
    process = subprocess.Popen([sys.executable, __file__, "--role", "decode", *common], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=DECODE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _end(process)
        raise SystemExit(f"disagg_demo: the decode process did not finish within {DECODE_TIMEOUT_S} s (stopped)") from None
    except BaseException:
        _end(process)
        raise
    if process.returncode != 0:
        raise SystemExit(f"decode failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _end(process: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Stops a child: SIGTERM (it cleans up: ``raise_on_sigterm``), then SIGKILL past ``grace_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def _status(code: int | None) -> str:
    return "still running" if code is None else f"exit status {code}" if code >= 0 else f"killed by signal {-code}"


def _stop(process: subprocess.Popen | None) -> None:
    """Lets the prefill process close its store and exit (it waits on its stdin); kills it
    if it does not within a minute, or is past answering."""
    if process is None:
        return
    try:
        process.communicate("done\n", timeout=60)
    except BaseException:  # noqa: BLE001 (a broken pipe, a timeout, a second Ctrl-C: it must not outlive the demo)
        _end(process)


def report(produced: dict, consumed: dict, args) -> int:
    """Prints both processes' figures and writes the JSON; returns the exit status: 1 (no
    TTFT, no speed-up, no JSON) when a hand-off fetched fewer blocks than it uses
    (``fetched_all``), decoded other tokens than the recompute or fetched other KV than the
    prompt's."""
    print(f"prompt {args.tokens} tokens, {BLOCK_TOKENS}-token blocks; tiny random Llama (4 layers, 4 KV heads, fp32 KV)")
    print(f"prefill process: prefill {produced['prefill_s'] * 1e3:.1f} ms, stored {produced['blocks']} blocks, "
          f"published {produced['published']} ({produced['bytes_put'] / 2**20:.1f} MiB) in {produced['store_s'] * 1e3:.1f} ms "
          f"(then {produced['copies'] - 1} untimed copies under other namespaces, one per further hand-off)")
    print(f"decode process:  found {consumed['found_tokens']} tokens by prefix ({consumed['exists_calls']} exists call), "
          f"fetched {consumed['remote_gets']} blocks ({consumed['bytes_fetched'] / 2**20:.1f} MiB) per hand-off")
    if not consumed["fetched_all"]:
        print(f"error: a hand-off fetched {consumed['fewest_fetched']} of the {consumed['expected_blocks']} blocks a hand-off uses "
              "from the remote tier (the prefill process or the master gone?): it recomputed instead of handing off; "
              "no TTFT or speed-up reported, no JSON written", file=sys.stderr)
        return 1
    if not consumed["same_tokens"]:
        print(f"error: the hand-off decoded other tokens than the recompute (first hand-off {consumed['tokens']}, "
              f"first recompute {consumed['recompute_tokens']}; not every run of either path agrees): the KV it "
              "fetched is not the prompt's; no TTFT or speed-up reported, no JSON written", file=sys.stderr)
        return 1
    if not consumed["same_kv"]:
        print(f"error: the KV a hand-off fetched differs from the prompt's KV recomputed in the decode process "
              f"(max |difference| {consumed['kv_max_abs_diff']:.3g}, at most {KV_TOLERANCE:g} accepted): it is not the "
              "prompt's KV as stored (blocks out of order, or another prompt's), even where it decodes the same tokens; "
              "no TTFT or speed-up reported, no JSON written", file=sys.stderr)
        return 1
    ms = {key: consumed[key] * 1e3 for key in ("ttft_handoff_s", "fetch_s", "rebuild_s", "tail_s", "ttft_recompute_s")}
    print(f"TTFT, medians of {consumed['repeats']} alternated runs after one warm-up each: hand-off {ms['ttft_handoff_s']:.1f} ms "
          f"(fetch {ms['fetch_s']:.1f}, rebuild cache {ms['rebuild_s']:.1f}, tail {ms['tail_s']:.1f}) vs recompute "
          f"{ms['ttft_recompute_s']:.1f} ms; speed-up (median of per-pair ratios) {consumed['ttft_speedup']:.2f}x")
    print(f"same {args.new_tokens} tokens decoded by every run of either path: {consumed['same_tokens']} {consumed['tokens']}")
    print("KV fetched by every hand-off: bit for bit the prompt's KV recomputed in the decode process")
    if args.json:
        try:  # checked before the run; a disk that fills now leaves an earlier file as it was
            replace_file(args.json, json.dumps({"prefill": produced, "decode": consumed}, indent=2), f"--json {args.json}")
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
