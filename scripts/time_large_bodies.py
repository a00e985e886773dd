"""How a server takes large request bodies: the answer's status and time for prompts of 10 MB and 50 MB, how
long /health takes meanwhile, and the server's resident memory before and after (issue 40 item 4).

    python scripts/time_large_bodies.py --serve "--set device=cpu --set dtype=float32"
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

import httpx
import psutil

from overload_bench import serving


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", required=True, metavar="ARGS", help="start `autodeploy serve ARGS`")
    args = parser.parse_args()
    with serving(args.serve) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        server = next(p for p in psutil.process_iter(["cmdline"]) if "serve" in (p.info["cmdline"] or []) and url.rsplit(":", 1)[1] in p.info["cmdline"])
        for megabytes in (10, 50):
            rss_before = server.memory_info().rss
            body = {"model": model, "prompt": "hello world " * (megabytes * 1024 * 1024 // 12), "max_tokens": 4}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                started = time.perf_counter()
                answer = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=600)
                health = []
                while not answer.done():
                    began = time.perf_counter()
                    httpx.get(f"{url}/health", timeout=600)
                    health.append(time.perf_counter() - began)
                    time.sleep(0.02)
                response = answer.result()
                elapsed = time.perf_counter() - started
            print(json.dumps({"prompt_mb": megabytes, "status": response.status_code, "answer_s": round(elapsed, 3),
                              "health_max_s": round(max(health, default=0.0), 3),
                              "rss_before_mb": rss_before // 2**20, "rss_after_mb": server.memory_info().rss // 2**20,
                              "message": response.json()["error"]["message"][:120]}), flush=True)


if __name__ == "__main__":
    main()
