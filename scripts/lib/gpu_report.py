"""scripts/gpu-check's report: a benchmark shape's rows summarised with the ratios against the
targets, and the whole report as markdown (report.md). Standard library only."""

from __future__ import annotations

import re


# The in-process engines bench_peers.py measures.
IN_PROCESS = ("remotehead", "remotehead_fused", "remotehead_memory")


def summarise_shape(s: dict) -> dict:
    shape, rows = s["shape"], s["results"]
    out = {"shape": shape["name"], "status": "ok", "n": shape["n"], "d": shape["d"],
           "v": shape["v"], "dtype": shape["dtype"], "softcap": shape["softcap"], "rows": {}}
    for peer, r in rows.items():
        if "skipped" in r:
            out["rows"][peer] = {"skipped": r["skipped"][-160:]}
        else:
            out["rows"][peer] = {k: r.get(k) for k in ("seconds", "peak_bytes",
                                                      "peak_with_grads_bytes", "d_loss",
                                                      "d_hidden")}
    timed = {k: r for k, r in out["rows"].items() if "seconds" in r}
    ours = timed.get("remotehead")
    peers = {k: r for k, r in timed.items() if not k.startswith("remotehead")}
    flops = 6 * shape["n"] * shape["d"] * shape["v"]
    if ours:
        out["tflops_in_process"] = flops / ours["seconds"] / 1e12
    if ours and peers:
        fastest = min(peers, key=lambda k: peers[k]["seconds"])
        out["vs_fastest_peer"] = {"peer": fastest,
                                  "time_ratio": ours["seconds"] / peers[fastest]["seconds"]}
    if ours and "cce" in timed:
        out["peak_vs_cce"] = ours["peak_with_grads_bytes"] / timed["cce"]["peak_with_grads_bytes"]
    if ours and "remotehead_server" in timed:
        out["server_vs_in_process"] = timed["remotehead_server"]["seconds"] / ours["seconds"]
    # Every in-process engine of the run (today's, the fused blocks, the memory mode) against the
    # same peers: one call measures them side by side.
    out["variants"] = {}
    for name in IN_PROCESS:
        mine = timed.get(name)
        if not mine:
            continue
        v = {"ms": mine["seconds"] * 1e3, "tflops": flops / mine["seconds"] / 1e12}
        if peers:
            fastest = min(peers, key=lambda k: peers[k]["seconds"])
            v["vs_fastest_peer"] = {"peer": fastest,
                                    "time_ratio": mine["seconds"] / peers[fastest]["seconds"]}
        if "cce" in timed:
            v["peak_vs_cce"] = mine["peak_with_grads_bytes"] / timed["cce"]["peak_with_grads_bytes"]
        out["variants"][name] = v
    return out


def why(message: str, limit: int = 200) -> str:
    """A failed test's message for the report's failures column: ": " and its first non-empty
    lines joined, at most `limit` characters (the logs in logs.tar.gz hold the rest) — so that a
    report printed by CI says what failed, not only where."""
    text = " / ".join(line.strip() for line in message.splitlines() if line.strip())
    text = text.replace("|", "/")  # the report is a Markdown table
    if not text:
        return ""
    return ": " + (text if len(text) <= limit else text[:limit - 1] + "…")


def rows_from_log(log: str) -> list[str]:
    """A cut or failed benchmark's printed rows (bench_peers.py prints each as it finishes)."""
    return [l for l in log.splitlines() if re.match(r"^\s+[a-z_]+\s{2}", l)]


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = ["# remotehead GPU check", "",
             f"- device: {r['device']}; GPU: {m.get('gpu') or 'none'} (capability "
             f"{m.get('capability') or '-'}); driver: {m.get('driver') or '-'}",
             f"- torch {m.get('torch')} (CUDA {m.get('torch_cuda') or '-'}); Python "
             f"{m.get('python')}; {m.get('cores')} cores; {m.get('platform')}",
             f"- nvcc: {m.get('nvcc') or '-'}; cmake: {m.get('cmake') or '-'}; "
             f"g++: {m.get('g++') or '-'}",
             f"- packages: " + ", ".join(f"{k} {v}" for k, v in (m.get("packages") or {}).items()
                                         if v),
             f"- generated stubs loaded with: {r.get('stubs_runtime', '-')}", "",
             "| phase | status | seconds | limit | detail |", "|---|---|---:|---:|---|"]
    for ph in r["phases"]:
        lines.append(f"| {ph['name']} | {ph['status']} | {ph['seconds']:.0f} | "
                     f"{ph['limit']:.0f} | {ph['detail']} |")
    if r["suites"]:
        lines += ["", "| suite | status | passed | failed | skipped | failures |",
                  "|---|---|---:|---:|---:|---|"]
        for s in r["suites"]:
            lines.append(f"| {s['suite']} | {s['status']} | {s['passed']} | {s['failed']} | "
                         f"{s['skipped']} | {', '.join(s['failures'][:5])} |")
    if r.get("wire"):
        w = r["wire"]
        streams = "; ".join(f"{c} stream{'s' * (c != '1')} {x['gb_per_s']:.2f} GB/s "
                            f"({x['vs_loopback']:.2f} of the limit)"
                            for c, x in w["streams"].items())
        lines += ["", f"**The wire** ({w['shape']}): a step's X up and dX down over {streams}; "
                  f"X and dX through the client and server alone {w['wire_gb_per_s']:.2f} GB/s; "
                  f"the whole step {w['step_gb_per_s']:.2f} GB/s; loopback TCP limit (one "
                  f"connection, same run) {w['loopback_tcp_gb_per_s']:.2f} GB/s"]
        if w.get("service"):
            s = w["service"]
            limits = "; ".join(f"{c} conn {gb:.2f}" for c, gb in s["loopback_tcp_gb_per_s"].items())
            lines += ["", f"**The service** (remotehead-wire-bench, the server on this machine's "
                      f"device; loopback limit {limits} GB/s; every C exact: "
                      f"{'yes' if s['exact'] else 'NO'}; in-process "
                      + ", ".join(f"{d} {t:.3f} s" for d, t in s["in_process_seconds"].items())
                      + ")", "", "| HTTP/2 | dtype | C | call s | GB/s | vs 1 conn | vs C conn | "
                      "server CPU-s per call | page faults per call (server / client) |",
                      "|---|---|---:|---:|---:|---:|---:|---|---|"]
            for row in s["rows"]:
                cpu = ", ".join(f"{k} {v:.3f}" for k, v in sorted(
                    row["server_cpu_seconds"].items(), key=lambda kv: -kv[1]) if v >= 0.0005)
                lines.append(f"| {row.get('http2', 'default')} | {row['dtype']} | "
                             f"{row['streams']} | {row['seconds']:.3f} | "
                             f"{row['gb_per_s']:.2f} | {row['vs_loopback_1']:.2f} | "
                             f"{row['vs_loopback_c']:.2f} | {cpu} | "
                             f"{row.get('server_minor_faults', -1):.0f} / "
                             f"{row.get('client_minor_faults', -1):.0f} |")
    for b in r["bench"]:
        lines += ["", f"**{b['shape']}**" + (f" (N={b['n']}, D={b['d']}, V={b['v']}, "
                                             f"{b['dtype']}, softcap {b['softcap']:g})"
                                             if "n" in b else f": {b['status']}")]
        if isinstance(b.get("rows"), list):
            lines += ["```", *b["rows"], "```"]
            continue
        lines += ["", "| contender | step ms | step peak MiB | +grads MiB | abs dloss | "
                  "max abs ddX |", "|---|---:|---:|---:|---:|---:|"]
        for peer, row in b["rows"].items():
            if "skipped" in row:
                lines.append(f"| {peer} | skipped: {row['skipped']} | | | | |")
                continue
            f = lambda v, s="{:.2e}": "-" if v is None else s.format(v)
            lines.append(f"| {peer} | {row['seconds'] * 1e3:.2f} | "
                         f"{row['peak_bytes'] / 2**20:.0f} | "
                         f"{row['peak_with_grads_bytes'] / 2**20:.0f} | {f(row['d_loss'])} | "
                         f"{f(row['d_hidden'])} |")
        ratios = []
        if "vs_fastest_peer" in b:
            v = b["vs_fastest_peer"]
            ratios.append(f"in-process / fastest peer ({v['peer']}): {v['time_ratio']:.3f}x "
                          f"time (target <= 1)")
        if "peak_vs_cce" in b:
            ratios.append(f"peak / CCE's (+grads): {b['peak_vs_cce']:.3f}x (target <= 1.2)")
        if "server_vs_in_process" in b:
            ratios.append(f"server on loopback / in-process: {b['server_vs_in_process']:.3f}x "
                          f"(target <= 1.15)")
        if "tflops_in_process" in b:
            ratios.append(f"6NDV / in-process step: {b['tflops_in_process']:.1f} TFLOP/s")
        for name, v in b.get("variants", {}).items():
            text = f"{name}: {v['ms']:.1f} ms, {v['tflops']:.0f} TFLOP/s"
            if "vs_fastest_peer" in v:
                text += (f", {v['vs_fastest_peer']['time_ratio']:.3f}x the fastest peer "
                         f"({v['vs_fastest_peer']['peer']})")
            if "peak_vs_cce" in v:
                text += f", peak {v['peak_vs_cce']:.3f}x CCE's (+grads)"
            ratios.append(text)
        lines += [""] + [f"- {x}" for x in ratios]
    return "\n".join(lines) + "\n"
