"""Open WebUI (PyPI `open-webui`) against our server, driven by headless Chromium: a chat, and its screenshot.

Installs Open WebUI once in its own venv (the CPU torch wheel first, so that its sentence-transformers does not pull
CUDA's), starts it with both of its connections pointed at the server (Ollama's API at --base-url, the OpenAI one
at --base-url/v1), login off, offline (no model hub, no telemetry, no update check), and checks that each
connection lists the server's model through Open WebUI's own API. Then Chromium opens the chat page (the model is
Open WebUI's default), sends --message, waits for the streamed answer to end and saves the page
(docs/open_webui.png). Open WebUI 0.12 hands its built-in tools to every model natively; for a model whose
`/api/show` lists no "tools" capability (the default SmolLM2: its chat template has no tool-call format, and the
server answers tools for it with a 400, as Ollama does) the user's function calling is set to Open WebUI's
prompt-based mode ("legacy"), as its documentation advises for such models. Not part of `make test`: the install is
some GBs and minutes.

Usage (Debian's chromium and chromium-driver, and selenium, installed; `make install` has them):
  python server.py --port 8000 &
  python scripts/open_webui_screenshot.py --base-url http://127.0.0.1:8000 --out docs/open_webui.png
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys


def install(venv: Path, version: str) -> Path:
    """The `open-webui` command of `venv`, installed there first if it is not yet."""
    exe = venv / "bin" / "open-webui"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU wheel, before anything asks for torch
        subprocess.run([*pip, f"open-webui=={version}" if version else "open-webui"], check=True)
    return exe


def start(exe: Path, base_url: str, model: str, port: int, data_dir: str) -> subprocess.Popen:
    """Open WebUI on 127.0.0.1:port with its Ollama and OpenAI connections at our server; ready on return."""
    env = os.environ | {
        "DATA_DIR": data_dir,
        "WEBUI_AUTH": "False",  # one local user, no sign-up page
        "WEBUI_SECRET_KEY": "screenshot",
        "ENABLE_OLLAMA_API": "True",
        "OLLAMA_BASE_URL": base_url,
        "ENABLE_OPENAI_API": "True",
        "OPENAI_API_BASE_URL": f"{base_url}/v1",
        "OPENAI_API_KEY": "none",
        "DEFAULT_MODELS": model,
        "OFFLINE_MODE": "True",
        "HF_HUB_OFFLINE": "1",
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False",
        "ENABLE_VERSION_UPDATE_CHECK": "False",
        "ANONYMIZED_TELEMETRY": "False",
        "DO_NOT_TRACK": "True",
        "SCARF_NO_ANALYTICS": "True",
        "ENABLE_TITLE_GENERATION": "False",
        "ENABLE_FOLLOW_UP_GENERATION": "False",
        "ENABLE_TAGS_GENERATION": "False",
        "ENABLE_AUTOCOMPLETE_GENERATION": "False",
    }
    log = open(Path(data_dir) / "open-webui.log", "w")
    proc = subprocess.Popen(
        [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log, stderr=log
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"open-webui exited ({proc.returncode}); see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.kill()
    raise RuntimeError(f"open-webui did not answer /health in 300 s; see {log.name}")


def browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))


def wait_for(driver, script: str, seconds: float, what: str):
    """The first truthy value of `script` run in the page, polled for up to `seconds`; RuntimeError naming `what`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="our server")
    ap.add_argument("--venv", default="/tmp/venv-openwebui")
    ap.add_argument("--version", default="0.12.4", help="open-webui release ('' for the newest)")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--message", default="Write a haiku about a small, fast inference server.")
    ap.add_argument("--out", default="docs/open_webui.png")
    args = ap.parse_args()

    tags = httpx.get(f"{args.base_url}/api/tags", timeout=10).json()["models"]
    model = tags[0]["name"]  # the name Ollama's API gives it, which Open WebUI lists as the model's id
    openai_ids = [m["id"] for m in httpx.get(f"{args.base_url}/v1/models", timeout=10).json()["data"]]
    show = httpx.post(f"{args.base_url}/api/show", json={"model": model}, timeout=10).json()
    capabilities_have_tools = "tools" in show.get("capabilities", [])
    exe = install(Path(args.venv), args.version)
    with tempfile.TemporaryDirectory() as data_dir:
        proc = start(exe, args.base_url, model, args.port, data_dir)
        driver = browser()
        try:
            ui = f"http://127.0.0.1:{args.port}"
            driver.get(ui)
            token = wait_for(driver, "return localStorage.token", 60, "Open WebUI's session token")
            auth = {"Authorization": f"Bearer {token}"}
            via_ollama = [
                m["name"] for m in httpx.get(f"{ui}/ollama/api/tags", headers=auth, timeout=30).json()["models"]
            ]
            via_openai = [m["id"] for m in httpx.get(f"{ui}/openai/models", headers=auth, timeout=30).json()["data"]]
            print(f"Open WebUI's Ollama connection lists {via_ollama}, its OpenAI connection {via_openai}")
            assert model in via_ollama and set(openai_ids) <= set(via_openai), "a connection did not list the model"
            if not capabilities_have_tools:  # Open WebUI sends its built-in tools natively unless told otherwise
                settings = {"ui": {"params": {"function_calling": "legacy"}}}
                httpx.post(f"{ui}/api/v1/users/user/settings/update", json=settings, headers=auth, timeout=30)
                driver.refresh()
            box = wait_for(driver, "return document.getElementById('chat-input')", 60, "the chat input")
            for dismiss in driver.find_elements(By.XPATH, '//button[contains(., "Okay, Let\'s Go!")]'):
                dismiss.click()  # the release notes shown at a first visit
            driver.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
            driver.execute_script("arguments[0].focus()", box)
            box.send_keys(args.message)
            box.send_keys(Keys.ENTER)
            # the answer streams into the last assistant message; done once the stop button is gone again
            wait_for(driver, "return document.querySelector('#response-content-container')", 120, "an answer")
            time.sleep(1)
            done = "return !document.querySelector('button[aria-label=\"Stop\"]')"
            wait_for(driver, done, 180, "the answer's end")
            answer = driver.find_elements(By.CSS_SELECTOR, "#response-content-container")[-1].text
            print(f"answer ({len(answer)} characters): {answer[:200]!r}")
            assert answer.strip(), "the answer is empty"
            driver.save_screenshot(args.out)
            print(f"wrote {args.out}")
        finally:
            driver.quit()
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
