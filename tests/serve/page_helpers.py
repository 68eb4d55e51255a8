"""The live page's test kit: a tiny model that spells text character by character (so markup in
a prompt reaches the tree's previews as it was typed), headless Debian chromium driven by
Selenium, and readers of the page and of `/metrics`."""

from __future__ import annotations

import os
import shutil
import string
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 60  # the longest any page condition is waited for (a 2-core CI machine, loaded)


def build_char_tokenizer() -> Any:
    """One id per printable ASCII character (and newline), ChatML turn markers as special
    tokens, EOS = id 2 as the tiny models expect; decoding joins characters back exactly."""
    from tiny_llama import CHATML
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="[UNK]")
    fast.chat_template = CHATML
    return fast


def char_model_dir(path: Path) -> Path:
    from tiny_llama import build_model

    build_model("gqa").save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


def start_browser(scratch: Path) -> Any:
    """Headless chromium through the system's chromedriver (Selenium Manager never runs: the
    driver is named), or skip when the machine has no browser (`scripts/setup_env.sh --test`
    installs both). The driver and the browser take `scratch` as their temp folder: Chromium
    leaves its `org.chromium.Chromium.*` singleton folder behind when the driver quits it, and
    that must land in pytest's own temp tree, not the machine's."""
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (Path(CHROMIUM).exists() and shutil.which(CHROMEDRIVER)):
        pytest.skip("chromium and chromium-driver are not installed")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,800")
    env = dict(os.environ, TMPDIR=str(scratch))
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER, env=env))
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    return driver


def wait_for(driver: Any, condition: Any, what: str) -> Any:
    """`condition(driver)` once it holds; a poll that met an element the page re-rendered
    meanwhile (the tree redraws at every snapshot) is tried again, not a failure."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(
        driver, WAIT_S, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)
    )
    return wait.until(condition, what)


def text_of(driver: Any, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def send_from_page(driver: Any, message: str) -> Any:
    """Type `message` into the page's chat, send it, and return the reply's element once its
    stream ended."""
    done_before = len(driver.find_elements("css selector", "#chat-log .msg.assistant.done"))
    box = driver.find_element("id", "message")
    box.clear()
    driver.execute_script("arguments[0].value = arguments[1];", box, message)
    driver.find_element("id", "send").click()
    selector = "#chat-log .msg.assistant.done"
    wait_for(
        driver, lambda d: len(d.find_elements("css selector", selector)) > done_before, "reply"
    )
    return driver.find_elements("css selector", selector)[-1]
