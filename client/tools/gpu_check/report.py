"""gpu-check's report: the one-page table (part, PASS/FAIL/SKIP/CUT, seconds, budget, figures) that
is printed at the end and on SIGTERM, and the detail tables of DIR/gpu_check.md."""
from __future__ import annotations

from client.tools.gpu_check.plan import PART_NAMES

# What must fail in the dry run: the instances serve from the CPU, and the device check says so.
EXPECTED_ON_CPU = {("served", "devices")}


def verdict(parts: dict, dry_run: bool) -> tuple[bool, list[str]]:
    """Every check passes (a part's sub-checks, else the part); skipped parts pass; in the dry run
    the checks that cannot pass on a CPU must fail, or they could not tell the CPU from a GPU."""
    problems = []
    for name, res in parts.items():
        if res.get("skipped"):
            continue
        checks = {k: v for k, v in res.items() if isinstance(v, dict) and "ok" in v}
        if not checks or res.get("cut") or (res.get("ok") is False and all(v["ok"] for v in checks.values())):
            checks = {None: res}   # judged whole: no sub-checks, cut short, or failed outside them
        for check, value in checks.items():
            label = name + (f".{check}" if check else "")
            if dry_run and (name, check) in EXPECTED_ON_CPU:
                if value["ok"]:
                    problems.append(f"{label}: passed on the CPU, so it cannot tell a CPU-served instance from a GPU one")
            elif not value.get("ok"):
                problems.append(f"{label}: {value.get('error') or value.get('reason') or 'failed'}")
    if dry_run:
        problems += [f"{n}.{c}: not run" for n, c in EXPECTED_ON_CPU
                     if c not in parts.get(n, {}) and not parts.get(n, {}).get("skipped")]
    return not problems, problems


def status(name: str, part: dict, problems: list[str]) -> str:
    if part.get("skipped"):
        return "SKIP"
    if part.get("cut"):
        return "CUT"
    failed = any(p.startswith(f"{name}:") or p.startswith(f"{name}.") for p in problems)
    return "FAIL" if failed else "PASS"


def figures(name: str, p: dict) -> str:
    """The part's result in a few words: its key numbers, or why it was skipped or failed."""
    if p.get("skipped"):
        return p["skipped"]
    if p.get("error") and not p.get("ok"):
        return p["error"].strip().splitlines()[-1][:160]
    if name == "environment":
        return (f"{p.get('gpus') or 'no GPU'}; sm {p.get('capability', '-')}; C compiler {p.get('cc') or 'MISSING'}; "
                f"Python.h {'ok' if p.get('python_h') else 'MISSING'}")
    if name == "compile":
        return (f"{p.get('compiled', 0)}/{p.get('variants', 0)} variants for {p.get('target')} in {p.get('workers')} "
                f"processes ({p.get('cached', 0)} already cached), {len(p.get('failed', []))} failed")
    if name == "kernels":
        checks = p.get("checks", []) + p.get("quant_checks", [])
        bad = sum(not c["ok"] for c in checks)
        best = max((r["pct_copy"] for r in p.get("decode_attention", [])), default=None)
        return (f"{len(checks) - bad}/{len(checks)} checks ok" +
                (f"; decode attention up to {best:.0f}% of copy bandwidth" if best is not None else ""))
    if name == "greedy" and p.get("batches"):
        d = p["dtype"]
        pos = sum(b[d]["positions"] for b in p["batches"])
        cols = "; ".join(f"{ref}: {sum(b[ref]['over'] for b in p['batches'])} over, max "
                         f"{max(b[ref]['max_gap_ulps'] for b in p['batches']):.1f} ulps, "
                         f"{100 * sum(b[ref]['exact'] for b in p['batches']) / max(pos, 1):.0f}% exact"
                         for ref in dict.fromkeys((d, "float32")))
        return f"{pos} positions, {p['ulps']:.0f} ulps allowed; {cols}"
    if name == "decode" and p.get("rows"):
        g = p["graph_vs_eager"]
        same = "graphs == eager" if g["ok"] else f"graphs != eager at {g['first_diff']}"
        best = max(p["rows"], key=lambda r: r["pct_of_floor"])
        return (f"{same} ({g['requests']} requests); best {best['pct_of_floor']:.0f}% of floor "
                f"(B={best['batch']} ctx={best['context']})")
    if name == "structured":
        return ", ".join(f"{k} {'ok' if v['ok'] else 'FAIL'}" for k, v in p.items() if isinstance(v, dict) and "ok" in v)
    if name == "served" and "devices" in p:
        return f"devices {p['devices']['devices']}; KV blocks {p['kv'].get('blocks')}"
    if name == "tp" and p.get("tp2"):
        return f"{p['same']}/{p['prompts']} identical; step {p['tp1']['step_ms']:.2f} -> {p['tp2']['step_ms']:.2f} ms"
    return ""


def table(res: dict) -> str:
    """The one-page summary: environment and every part, in run order."""
    env, parts = res["environment"], res["parts"]
    lines = [f"### gpu-check {res['date']} on {res['device']}", "",
             f"torch {env.get('torch')} (CUDA {env.get('cuda')}), triton {env.get('triton')}, python {env.get('python')}; "
             f"{'PASS' if res.get('ok') else 'FAIL'} in {res.get('wall_s', 0):.0f} s"
             + (f" (stopped: {res['stopped']})" if res.get("stopped") else ""), "",
             "| part | result | seconds | budget | figures |", "| --- | --- | ---: | ---: | --- |",
             f"| environment | {'PASS' if env.get('ok') else 'FAIL'} | | | {figures('environment', env)} |"]
    problems = res.get("problems", [])
    for name in PART_NAMES:
        p = parts.get(name)
        if p is None:
            lines.append(f"| {name} | not run | | | {res.get('stopped') or ''} |")
            continue
        result = status(name, p, problems)
        if res["dry_run"] and result == "PASS" and not p.get("ok") and not p.get("skipped"):
            result = "PASS (its device check failed, as it must on a CPU)"
        lines.append(f"| {name} | {result} | {p.get('seconds', 0):.0f} | {p.get('budget', '')} | "
                     f"{figures(name, p).replace('|', '/')} |")
    return "\n".join(lines + [f"- {p}" for p in problems]) + "\n"


def details(res: dict) -> str:
    """The tables to paste into docs/performance.md."""
    parts, lines = res["parts"], []
    k = parts.get("kernels", {})
    if k.get("checks"):
        lines += ["", "| kernel | dtype | max abs err | ok |", "| --- | --- | ---: | --- |"]
        lines += [f"| {c['kernel']} ({c['detail']}) | {c['dtype']} | {c['max_abs_err']:.2e} | {'ok' if c['ok'] else 'FAIL'} |"
                  for c in k["checks"]]
        lines += ["", f"Copy bandwidth {k.get('copy_bandwidth_gbs', 0):.0f} GB/s.", "",
                  "| decode attention (8B heads) | us | % of copy bandwidth | splits |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| B={r['batch']} ctx={r['context']} | {r['us']:.1f} | {r['pct_copy']:.1f} | {r['splits']} |"
                  for r in k.get("decode_attention", [])]
    g = parts.get("greedy", {})
    if g.get("batches"):
        e, d = g["engine"], g["dtype"]
        lines += ["", f"Greedy, teacher-forced, on {e['device']} ({d}, graphs {e['graphs']}); tolerance "
                      f"{g['ulps']:.0f} ulps of the top logit in {d}:", "",
                  "| batch | prompt tokens | reference | positions | exact | over | max gap (ulps) | first difference |",
                  "| ---: | --- | --- | ---: | ---: | ---: | --- | --- |"]
        for b in g["batches"]:
            for ref in dict.fromkeys((d, "float32")):
                r, f = b[ref], b[ref]["first_diff"]
                first = (f"seq {f['sequence']} pos {f['position']}: {f['engine_token']} ({f['engine_token_logit']:.3f}) "
                         f"vs {f['reference_token']} ({f['reference_top_logit']:.3f})") if f else "-"
                lines.append(f"| {b['batch']} | {b['prompt_tokens'][0]}-{b['prompt_tokens'][1]} | {ref} | {r['positions']} | "
                             f"{r['exact']} | {r['over']} | {r['max_gap']:.3f} ({r['max_gap_ulps']:.1f}) | {first} |")
    dec = parts.get("decode", {})
    if dec.get("rows"):
        lines += ["", f"Engine decode step (LLMEngine.step), {dec['weight_gb']:.2f} GB of weights, copy bandwidth "
                      f"{dec['copy_bandwidth_gbs']:.0f} GB/s:", "",
                  "| batch | context | weights | graphs | engine ms | microbench ms | floor ms | % of floor | tok/s |",
                  "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['batch']} | {r['context']} | {r.get('weights', 'none')} | {'on' if r['graphs'] else 'off'} | "
                  f"{r['engine_ms']:.2f} | {(r['microbench_ms'] or 0):.2f} | {r['floor_ms']:.2f} | "
                  f"{r['pct_of_floor']:.1f} | {r['tokens_per_s']:.0f} |" for r in dec["rows"]]
        lines += ["", f"quantization=fp8: {dec.get('fp8', 'not run')} (the fp8 rows' floor counts their own bytes)."]
    s = parts.get("served", {})
    if "devices" in s:
        lines += ["", f"Served, two instances on one device: devices {s['devices']['devices']} "
                      f"({'ok' if s['devices']['ok'] else 'NOT ALL ON A GPU'}); KV blocks {s['kv'].get('blocks')}"]
        for r in s.get("throughput", {}).get("ratios", []):
            lines.append(f"Served / in-process ({r['kind']}, concurrency {r['concurrency']}): {r['ratio']:.2f}x")
    t = parts.get("tp", {})
    if t.get("tp2"):
        lines += ["", f"Tensor parallelism, {t['gpus']} GPUs: TP=2 (NCCL) vs one rank, greedy on {t['prompts']} prompts: "
                      f"{t['same']} identical, {len(t['near_tie_flips'])} first differ at a near-tie "
                      f"(<= {t['near_tie']}), {len(t['not_near_tie'])} elsewhere.", "",
                  "| ranks | decode step ms (16 rows) | CUDA graphs | load s |", "| ---: | ---: | --- | ---: |"]
        lines += [f"| {n} | {t[k]['step_ms']:.2f} | {t[k]['graphs']} | {t[k]['load_s']} |" for n, k in ((1, "tp1"), (2, "tp2"))]
    return "\n".join(lines) + "\n"
