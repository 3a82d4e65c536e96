"""README.md's examples, run as written on tiny checkpoints.

Every fenced block of README.md is one of:
- an example, ```bash, ```python or ```console, run here: in README order, all in one temporary
  directory (the cwd), each block seeing what the earlier ones wrote, as a reader following along;
- an example marked as not runnable here by its first line `# needs: <what>` (a ROCm GPU, ATOM,
  vLLM serving): checked for syntax (`bash -n`, `compile`) and its `atom-convert` command lines
  parsed by the real click command (so an option that does not exist fails), not run;
- one of the two Quick start commands, checked verbatim (they run from fresh clones: `.ci/run`);
- ```text: a listing, not an example.
Any other fence (none, or another language) fails, so a new example cannot go untested silently.

The cwd holds the checkpoints under the names the README uses (copies, built once per session):
  ./DeepSeek-V3, ./DeepSeek-R1   tiny_checkpoint("tiny-deepseek-v3", "fp8")   (conftest.py)
  ./Kimi-K2-Instruct             tiny_checkpoint("tiny-kimi-k2", "fp8")
  ./Kimi-K2-Thinking-MXFP4       atom_convert.synth.build_random of tiny-kimi-k2 at hidden_size 256,
                                 fmt="mxfp4": a Quark-style MXFP4 export (routed experts MXFP4, the rest
                                 bf16, as Quark's kimi_k2 template writes it), made without the 16-20 s
                                 import of Quark that conftest's quark_checkpoint costs.
Hub repo ids (tests/hubserver.py on 127.0.0.1; HF_ENDPOINT points at it, HF_HOME is in the tmp dir,
HF_TOKEN is its test token, HF_HUB_DISABLE_XET=1, HF_HUB_OFFLINE unset):
  deepseek-ai/DeepSeek-R1        the files of ./DeepSeek-R1
  moonshotai/Kimi-K2-Instruct    the files of ./Kimi-K2-Instruct
  my-org/...                     whatever the README's own upload examples create.

Substitution (the only change made to a block's text): the tiny models have 4 attention heads, so the
full-width tensor-parallel size 8 becomes 2 in `--tp 8`, `-tp 8`, `tp=8` and `"tp": 8`.

How blocks run: bash with `-euo pipefail`, this venv's bin first on PATH (`atom-convert`, `python`);
python on this venv's interpreter (stdin); console: each `$ ` line through bash, its output (stdout and
stderr) must hold every line that follows it, a line ending in `...` matching as a prefix.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import click
import pytest

from atom_convert.cli import cli
from atom_convert.synth import build_random, load_preset

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
EXAMPLE_LANGS = ("bash", "python", "console")
LANGS = EXAMPLE_LANGS + ("text",)
NEEDS = re.compile(r"^# needs: (\S.*)$")
QUICK_START = ("bash scripts/setup.sh && .venv/bin/atom-convert demo",
               "bash scripts/setup.sh --test && .venv/bin/python -m pytest -q")
SUBSTITUTIONS = ((re.compile(r"(--tp|-tp) 8\b"), r"\1 2"), (re.compile(r"\btp=8\b"), "tp=2"),
                 (re.compile(r'"tp": 8\b'), '"tp": 2'))
HUB_TOKEN = "hf_test_token"


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    section: str  # the `## ` heading it is under

    @property
    def needs(self) -> str | None:
        first = self.text.splitlines()[0] if self.text else ""
        m = NEEDS.match(first)
        return m.group(1) if m else None

    @property
    def kind(self) -> str:
        if self.lang == "text":
            return "listing"
        if self.text.strip() in QUICK_START:
            return "quick-start"
        return "marked" if self.needs else "run"

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang}, {self.section})"


def blocks(path: Path = README) -> list[Block]:
    out: list[Block] = []
    section, opened, lang, body = "", 0, "", []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not opened:
            if line.startswith("## "):
                section = line[3:].strip()
            m = re.match(r"^\s*```(.*)$", line)
            if m:
                opened, lang, body = i, m.group(1).strip(), []
        elif re.match(r"^\s*```\s*$", line):
            out.append(Block(opened, lang, "\n".join(body) + "\n", section))
            opened = 0
        else:
            body.append(line)
    assert not opened, f"README.md:{opened}: fence never closed"
    return out


def substitute(text: str) -> str:
    for pat, rep in SUBSTITUTIONS:
        text = pat.sub(rep, text)
    return text


def command_lines(b: Block) -> list[str]:
    """The block's shell command lines (continuations joined, comments and console output dropped)."""
    lines = b.text.replace("\\\n", " ").splitlines()
    if b.lang == "console":
        lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
    return [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def check_atom_convert_args(line: str) -> None:
    """Parse an `atom-convert ...` command (the first one of a `&&`/`;`/`|` chain) with the real
    click command, without running it: unknown options or bad choices raise."""
    words = shlex.split(line, comments=True)
    for stop in ("&&", ";", "|", ">", "||"):
        if stop in words:
            words = words[:words.index(stop)]
    if not words or not words[0].endswith("atom-convert"):
        return
    cmd = cli.commands.get(words[1]) if len(words) > 1 else None
    assert cmd is not None, f"no atom-convert command in: {line}"
    try:
        cmd.make_context(words[1], words[2:])  # parses and converts every option; runs nothing
    except click.BadParameter as e:
        if "does not exist" not in str(e):  # a path the README names need not exist here
            raise


# ------------------------------------------------------------------------------------------------
# the workspace: checkpoints under the README's names, the Hub double with its repos
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub() -> Iterator[object]:
    from huggingface_hub import constants
    from hubserver import FakeHub

    server = FakeHub().start()
    with pytest.MonkeyPatch.context() as mp:  # for the publishing done in this process (HfApi)
        mp.setattr(constants, "ENDPOINT", server.url)
        mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
        mp.setattr(constants, "HF_HUB_DISABLE_XET", True)
        mp.setattr(constants, "HF_HUB_OFFLINE", False)
        mp.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
        yield server
    server.stop()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[..., Path], hub) -> tuple[Path, dict[str, str]]:
    from huggingface_hub import HfApi

    root = tmp_path_factory.mktemp("readme")
    cwd = root / "cwd"
    cwd.mkdir()
    shutil.copytree(tiny_checkpoint("tiny-deepseek-v3", "fp8"), cwd / "DeepSeek-V3")
    shutil.copytree(tiny_checkpoint("tiny-deepseek-v3", "fp8"), cwd / "DeepSeek-R1")
    shutil.copytree(tiny_checkpoint("tiny-kimi-k2", "fp8"), cwd / "Kimi-K2-Instruct")
    build_random(dict(load_preset("tiny-kimi-k2"), hidden_size=256), cwd / "Kimi-K2-Thinking-MXFP4", fmt="mxfp4",
                 weights="gaussian", shard_bytes=2_000_000, threads=1)
    api = HfApi(endpoint=hub.url, token=HUB_TOKEN)
    for repo, folder in (("deepseek-ai/DeepSeek-R1", "DeepSeek-R1"), ("moonshotai/Kimi-K2-Instruct", "Kimi-K2-Instruct")):
        api.create_repo(repo)
        api.upload_folder(folder_path=cwd / folder, repo_id=repo)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", HF_ENDPOINT=hub.url, HF_HOME=str(root / "hf-home"),
               HF_TOKEN=HUB_TOKEN, HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               PYTHONPATH=str(ROOT))
    return cwd, env


def run_block(b: Block, cwd: Path, env: dict[str, str]) -> None:
    text = substitute(b.text)

    def run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, input=stdin, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)

    if b.lang == "bash":
        r = run(["bash", "-euo", "pipefail", "-c", text])
        assert r.returncode == 0, f"{b}: exit {r.returncode}\n{text}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    elif b.lang == "python":
        r = run([sys.executable, "-"], stdin=text)
        assert r.returncode == 0, f"{b}: exit {r.returncode}\n{text}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    else:  # console
        lines = text.splitlines()
        starts = [i for i, ln in enumerate(lines) if ln.startswith("$ ")]
        assert starts and starts[0] == 0, f"{b}: a console block starts with a `$ ` command line"
        for k, i in enumerate(starts):
            expected = lines[i + 1: starts[k + 1] if k + 1 < len(starts) else len(lines)]
            r = run(["bash", "-c", lines[i][2:]])
            got = (r.stdout + r.stderr).splitlines()
            for want in expected:
                ok = (any(g.startswith(want[:-3]) for g in got) if want.endswith("...") else want in got)
                assert ok, f"{b}: `{lines[i][2:]}` printed no line {want!r}:\n" + "\n".join(got)


# ------------------------------------------------------------------------------------------------


def test_every_fence_is_an_example_or_a_listing() -> None:
    bs = blocks()
    assert bs, "README.md has no code blocks"
    bad = [f"{b}: fence language {b.lang!r} (use one of {', '.join(LANGS)})" for b in bs if b.lang not in LANGS]
    assert not bad, "\n".join(bad)
    empty = [str(b) for b in bs if b.lang in EXAMPLE_LANGS and not command_lines(b) and b.lang != "python"]
    assert not empty, f"example blocks without a command: {empty}"


def test_quick_start_is_the_two_commands_verbatim() -> None:
    qs = [b for b in blocks() if b.section == "Quick start"]
    assert [(b.lang, b.text.strip()) for b in qs] == [("bash", c) for c in QUICK_START]
    assert all(b.kind == "quick-start" for b in qs)
    assert not [b for b in blocks() if b.kind == "quick-start" and b.section != "Quick start"]
    # what they call exists: the setup script (with --test), the demo command, and .ci/run runs the second
    assert "--test" in (ROOT / "scripts" / "setup.sh").read_text()
    check_atom_convert_args("atom-convert demo")
    assert QUICK_START[1] in (ROOT / ".ci" / "run").read_text()


def test_marked_blocks_say_what_they_need_and_parse() -> None:
    marked = [b for b in blocks() if b.kind == "marked"]
    for b in marked:
        assert b.lang in EXAMPLE_LANGS, f"{b}: only examples carry `# needs:`"
        assert b.needs and len(b.needs) > 3, f"{b}: `# needs:` without a reason"
        if b.lang == "python":
            compile(b.text, str(b), "exec")
        else:
            src = "\n".join(command_lines(b))
            r = subprocess.run(["bash", "-n", "-c", src], capture_output=True, text=True)
            assert r.returncode == 0, f"{b}: {r.stderr}"
            for line in command_lines(b):
                check_atom_convert_args(line)
    # a marker anywhere but the first line is a mistake that would leave the block running
    for b in blocks():
        for extra in b.text.splitlines()[1:]:
            assert not NEEDS.match(extra), f"{b}: `# needs:` must be the block's first line"


def test_readme_has_no_dated_measurements() -> None:
    text = README.read_text()
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text), "dates belong in BENCHMARKS.md / VERIFICATION.md"
    assert not re.findall(r"\d(?:\.\d+)? ?[GM]B/s", text), "throughput numbers belong in BENCHMARKS.md (docs/ cite it)"


def test_relative_links_resolve() -> None:
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: link to missing {target}"


def test_readme_examples_run(workspace: tuple[Path, dict[str, str]], hub) -> None:
    """Every unmarked example block, in README order, in one cwd."""
    cwd, env = workspace
    bs = blocks()
    ran: list[Block] = []
    for b in bs:
        if b.kind == "run":
            run_block(b, cwd, env)
            ran.append(b)
    # every example block was either run here or is marked (or is a Quick start command)
    examples = [b for b in bs if b.lang in EXAMPLE_LANGS]
    unaccounted = [str(b) for b in examples if b not in ran and b.kind not in ("marked", "quick-start")]
    assert not unaccounted, unaccounted
    counts = {k: sum(b.kind == k for b in examples) for k in ("run", "marked", "quick-start")}
    print(f"README examples: {counts['run']} run, {counts['marked']} marked `# needs:`, "
          f"{counts['quick-start']} quick start (fresh clones)")
    assert counts["run"] == len(ran) and counts["run"] > counts["marked"]
    # what the examples say they produce is there
    assert (cwd / "DeepSeek-V3-atom-mi355" / "atom_manifest.json").is_file()
    assert not (cwd / "kimi-mi300").exists()  # --dry-run writes nothing
    assert (cwd / "r1-atom" / "atom_verify.json").is_file()
    assert (cwd / "r1-atom-pulled" / "atom_manifest.json").is_file()
    pulled = [p for m, p in hub.requests if m == "GET" and "/my-org/DeepSeek-R1-atom-gfx950-tp8/resolve/" in p]
    assert any("model-rank" in p for p in pulled), "--hub-cache converted instead of pulling the uploaded shards"
