"""Take the README's picture of the live page: a real conversation typed into the page's chat
in headless Debian chromium (driven by Selenium through the system's chromedriver).

    .venv/bin/python scripts/page_screenshot.py docs/live-page.png [--model PATH_OR_ID]

It starts `radixkv serve`'s app on 127.0.0.1 (an ephemeral port) over the model (default: the
embedded SmolLM2-135M-Instruct), sends the turns of TURNS greedily, and saves the window.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

TURNS = [
    "What is the capital of Japan?",
    "Name one famous dish from there.",
    "Suggest two places to visit in Tokyo.",
]


def serve(model: str | None) -> tuple[str, object]:
    from radixkv.engine import LLM
    from radixkv.serve.app import create_app
    from radixkv.serve.config import ServeConfig
    from radixkv.serve.http_server import build_server

    llm = LLM(model, max_model_len=2048) if model else LLM(max_model_len=2048)
    app = create_app(llm, ServeConfig(model_name=llm.model_name, ui=True))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = build_server(app, app.state.server.config, log_level="warning")
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/", server


def browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,760")
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    url, server = serve(args.model)
    driver = browser()
    try:
        driver.get(url)
        wait = WebDriverWait(driver, 120, poll_frequency=0.1)
        wait.until(lambda d: d.find_element("id", "status").text == "live")
        driver.find_element("id", "temperature").send_keys("0")
        done = "#chat-log .msg.assistant.done"
        for i, turn in enumerate(TURNS, 1):
            driver.find_element("id", "message").send_keys(turn)
            driver.find_element("id", "send").click()
            wait.until(lambda d, i=i: len(d.find_elements("css selector", done)) == i)
        time.sleep(1.0)  # the next snapshot (<= 4 a second) shows the last turn's path
        driver.save_screenshot(args.out)
    finally:
        driver.quit()
        server.should_exit = True


if __name__ == "__main__":
    main()
