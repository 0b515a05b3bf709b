"""Screenshot of the dashboard under load (the picture in the README), taken with headless Chromium.

Sends `--requests` streaming chat-style completions at once, each a shared system prompt followed by a
prompt of the default workload (so the KV map shows shared prefix blocks and the timeline shows chunked
prefills next to decodes), and saves the page once requests run and wait.

Usage (Debian's chromium and chromium-driver, and selenium, installed):
  python server.py --port 8000 --kv-cache-memory 256M --max-num-seqs 16 --max-num-batched-tokens 256 &
  python scripts/dashboard_screenshot.py --base-url http://127.0.0.1:8000 --out docs/dashboard.png
"""

import argparse
import asyncio
import shutil
import time

import httpx
from bench_common import DEFAULT_WORKLOAD, load_jsonl
from selenium import webdriver

SYSTEM = (
    "You are a careful assistant for a small research team. Answer clearly, cite the facts you rely "
    "on, keep answers short unless asked otherwise, and say so when you do not know. "
) * 3


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> None:
    body = {"prompt": SYSTEM + prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for _ in resp.aiter_lines():
            pass


async def main(args) -> None:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,1080"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    if args.dark:
        driver.execute_cdp_cmd(
            "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}
        )
    try:
        key = f"#key={args.api_key}" if args.api_key else ""
        driver.get(f"{args.base_url}/dashboard{key}")
        while not driver.execute_script("return window.dashboard.events > 0"):
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        reqs = [r for r in load_jsonl(DEFAULT_WORKLOAD) if r.prompt][: args.requests]
        async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None) as client:
            load = asyncio.gather(*(stream(client, r.prompt[:1500], 48 + 8 * i) for i, r in enumerate(reqs)))
            state = "return [window.dashboard.payload.engine.num_running, window.dashboard.payload.engine.num_waiting]"
            while not load.done():
                running, waiting = driver.execute_script(state)
                if running >= args.min_running and waiting:
                    await asyncio.sleep(args.settle)  # let the step timeline fill
                    driver.save_screenshot(args.out)
                    print(f"wrote {args.out} ({running} running, {waiting} waiting)")
                    break
                await asyncio.sleep(0.2)
            else:
                print(f"never saw {args.min_running} requests running with some waiting: no picture taken")
            await load
    finally:
        driver.quit()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--min-running", type=int, default=12, help="take the picture once this many run and some wait")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds to wait after that")
    ap.add_argument("--dark", action="store_true", help="the page in dark mode")
    ap.add_argument("--out", default="docs/dashboard.png")
    asyncio.run(main(ap.parse_args()))
