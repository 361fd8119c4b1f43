"""The disk KV tier against whoever else can reach its folder (issue 46, causes 1, 8, 9 and 10, and a
folder shared by several engines): its folder 0700 and files 0600 whatever the umask, and another
user can neither list nor read them (a real second uid when the tests run as root); a file forged or
copied without the folder's secret is refused as tampered, counted and computed again; links,
subfolders and files appearing and vanishing under a scan never fail a start, and no link is ever
followed; a folder that cannot be used is one line naming kv_disk_cache_dir; engines sharing a
folder keep to one kv_disk_cache_bytes; greedy outputs with the tier equal those without.
docs/reliability.md records what each test tried and what it found."""
import hashlib
import hmac
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from backend import LLM, SamplingParams
from backend.kv.block_pool import block_hashes
from backend.kv.tiers.disk import DiskStore
from hf_checkpoints import make_checkpoint
from test_kv_tiers import BLOCK_BYTES, ENGINE, FILE_BYTES

FP, KEY, BLOCK = b"F" * 32, b"k" * 32, 64
OTHER_UID = 65534  # nobody
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root (docs/reliability.md has the run)")
REPO = Path(__file__).resolve().parents[1]


def roundtrip(store, key=KEY, block=None):
    """Write then read back one block; (the read's ok, its reason, the bytes read)."""
    block = np.arange(BLOCK, dtype=np.uint8) if block is None else block
    store.write(1, key, block)
    store.drain(5)
    out = np.zeros(BLOCK, dtype=np.uint8)
    store.read(2, key, out)
    store.drain(5)
    done = dict((token, (ok, why)) for token, ok, why in store.completed())
    return (*done[2], out)


def reseal(path: Path, payload: bytes) -> None:
    """What someone who can write the folder but has not its secret can do: a payload of their choice
    under the file's header, sealed as well as they can (anyone recomputes a CRC-32; an HMAC needs
    the secret, so a guessed one)."""
    data = path.read_bytes()
    if data[7] == 1:  # format 1 (before issue 46): <8s32s32sQI4x> header with a CRC-32, the payload
        head = bytearray(data[:88])
        struct.pack_into("<I", head, 80, zlib.crc32(payload))
        path.write_bytes(bytes(head) + payload)
    else:  # format 2: <8s32s32sQ> header, the payload, HMAC-SHA256(secret, header + payload)
        head = data[:80]
        path.write_bytes(head + payload + hmac.new(os.urandom(32), head + payload, hashlib.sha256).digest())


def as_user(uid: int, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), user=uid, group=uid, extra_groups=[], capture_output=True, timeout=30)


@pytest.fixture
def reachable_dir():
    """A folder every user may enter (0755, under /tmp): only the tier's own modes keep others out
    (pytest's tmp_path is under a 0700 folder, which would keep them out whatever the tier did)."""
    base = Path(tempfile.mkdtemp(prefix="inflight-tier-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


# -- cause 1: who can read it, who can change it ----------------------------------------------------
def test_cause1_the_folder_is_0700_and_its_files_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        store = DiskStore(str(tmp_path / "new" / "kv"), FP, BLOCK)
        assert roundtrip(store)[0]
        existing = tmp_path / "old"
        (existing / FP.hex()[:32]).mkdir(parents=True)
        (existing / FP.hex()[:32] / f"{(b'o' * 32).hex()}.kv").write_bytes(b"format 1")
        for p in (existing, existing / FP.hex()[:32]):
            os.chmod(p, 0o755)  # an earlier version's folder (made under umask 022)
        os.chmod(existing / FP.hex()[:32] / f"{(b'o' * 32).hex()}.kv", 0o644)
        again = DiskStore(str(existing), FP, BLOCK)
        assert again.scan() == []  # the format-1 file (another size) deleted
        assert roundtrip(again)[0]
    finally:
        os.umask(old)
    for root in (tmp_path / "new" / "kv", existing):
        entries = [root, *root.rglob("*")]
        assert len(entries) >= 3
        for p in entries:
            mode = stat.S_IMODE(p.lstat().st_mode)
            assert mode == (0o700 if p.is_dir() else 0o600), (str(p), oct(mode))
    store.close()
    again.close()


def test_cause1_a_block_forged_without_the_folders_secret_is_refused_as_tampered(tmp_path):
    store = DiskStore(str(tmp_path), FP, BLOCK)
    assert roundtrip(store)[0]
    reseal(store.path(KEY), bytes(range(100, 100 + BLOCK)))  # someone else's KV under this key
    out = np.zeros(BLOCK, dtype=np.uint8)
    store.read(3, KEY, out)
    store.drain(5)
    ((_, ok, why),) = store.completed()
    assert not ok and why.startswith("tampered"), why
    assert not store.path(KEY).exists()  # deleted: its block is computed again
    store.close()


def test_cause1_a_file_of_another_folder_is_refused_as_tampered(tmp_path):
    """The same model and key in another folder (another secret): its file, copied here, is not ours."""
    a, b = DiskStore(str(tmp_path / "a"), FP, BLOCK), DiskStore(str(tmp_path / "b"), FP, BLOCK)
    assert roundtrip(a, block=np.full(BLOCK, 7, np.uint8))[0]
    assert roundtrip(b, block=np.full(BLOCK, 9, np.uint8))[0]
    shutil.copyfile(a.path(KEY), b.path(KEY))
    out = np.zeros(BLOCK, dtype=np.uint8)
    b.read(3, KEY, out)
    b.drain(5)
    ((_, ok, why),) = b.completed()
    assert not ok and why.startswith("tampered"), why
    a.close()
    b.close()


@ROOT_ONLY
def test_cause1_another_user_can_neither_list_nor_read_the_tier(reachable_dir):
    store = DiskStore(str(reachable_dir / "kv"), FP, BLOCK)
    assert roundtrip(store)[0]
    store.close()
    assert as_user(0, "cat", str(store.path(KEY))).returncode == 0  # the owner reads it
    for argv in (["ls", str(reachable_dir / "kv")], ["ls", str(store.folder)], ["cat", str(store.path(KEY))],
                 ["cat", str(reachable_dir / "kv" / ".secret")], ["touch", str(store.folder / "x.kv")]):
        got = as_user(OTHER_UID, *argv)
        assert got.returncode != 0 and not got.stdout and b"Permission denied" in got.stderr, (argv, got)


# -- cause 8: what the folder holds besides the tier's files never fails a start -------------------
def test_cause8_links_and_subfolders_in_the_folder_are_skipped_and_counted(tmp_path):
    store = DiskStore(str(tmp_path), FP, BLOCK)
    assert roundtrip(store)[0]
    store.close()
    folder = store.folder
    (folder / f"{(b'd' * 32).hex()}.kv").symlink_to(tmp_path / "nowhere")  # dangling
    (folder / "sub").mkdir()
    (folder / f"{(b'e' * 32).hex()}.kv").mkdir()
    (folder / "notes.txt").write_text("not the tier's")
    again = DiskStore(str(tmp_path), FP, BLOCK)
    assert again.scan() == [KEY]
    assert again.unreadable == 4
    assert (folder / "sub").is_dir() and (folder / f"{(b'd' * 32).hex()}.kv").is_symlink()  # skipped, not deleted
    assert (folder / "notes.txt").read_text() == "not the tier's"
    again.close()


CHURN = """
import sys, time
import numpy as np
from backend.kv.tiers.disk import DiskStore
root, seconds, budget, first = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]) or None, int(sys.argv[4])
store = DiskStore(root, b"F" * 32, 64, *([budget] if budget else []))
block, end, i = np.zeros(64, np.uint8), time.monotonic() + seconds, first
print("ready", flush=True)
while time.monotonic() < end:
    store.write(None, i.to_bytes(32, "big"), block)
    if not budget and i >= first + 4:  # an engine's own LRU deletes (without a folder budget)
        store.delete((i - 4).to_bytes(32, "big"))
    store.drain(5)
    i += 1
store.close()
print(i - first, flush=True)
"""


def churn(root: Path, seconds: float, budget: int = 0, first: int = 0) -> subprocess.Popen:
    """An engine of the same model in another process, writing (temporary name, rename) and
    deleting files as fast as it can."""
    proc = subprocess.Popen([sys.executable, "-c", CHURN, str(root), str(seconds), str(budget), str(first)],
                            cwd=REPO, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def finished(proc: subprocess.Popen) -> int:
    written = int(proc.stdout.read().split()[-1])
    assert proc.wait() == 0
    return written


@pytest.mark.slow  # 4 s of two processes racing
def test_cause8_starts_beside_an_engine_writing_and_deleting_in_the_same_folder_never_fail(tmp_path):
    """Another engine of the same model writes (temporary name, rename) and evicts files all the time;
    engines starting meanwhile scan the folder. Before, a file gone between the listing and its stat
    failed the start (24 of 3,023 in the audit)."""
    other = churn(tmp_path, 4)
    starts, failures = 0, []
    while other.poll() is None:
        try:
            store = DiskStore(str(tmp_path), FP, BLOCK)
            store.scan()
            store.close()
        except Exception as exc:  # noqa: BLE001 (what a start would have raised)
            failures.append(repr(exc))
        starts += 1
    assert finished(other) > 100
    assert starts > 50 and not failures, (starts, failures[:3], len(failures))


@pytest.mark.slow  # 3 s of two processes racing
def test_two_engines_writing_at_once_keep_the_folders_count_and_budget(tmp_path):
    """Each put in place and each deletion changes the folder's count under its lock: however the
    two interleave, the count is the folder's bytes and never passes the budget."""
    file_bytes = 80 + BLOCK + 32
    for budget in (1 << 40, 16 * file_bytes):  # never reached (every file counted), then passed all the time
        DiskStore(str(tmp_path), FP, BLOCK, budget).close()
        a, b = churn(tmp_path, 2, budget, 0), churn(tmp_path, 2, budget, 1 << 20)
        assert finished(a) > 50 and finished(b) > 50
        sizes = [f.stat().st_size for f in block_files(tmp_path)]
        assert 0 < sum(sizes) <= budget and int((tmp_path / ".usage").read_text()) == sum(sizes), (len(sizes), budget)


# -- cause 9: no link followed ---------------------------------------------------------------------
def test_cause9_a_linked_model_folder_is_replaced_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("keep")
    (outside / "x.kv").write_bytes(b"not a block")
    root = tmp_path / "kv"
    root.mkdir()
    (root / FP.hex()[:32]).symlink_to(outside)
    store = DiskStore(str(root), FP, BLOCK)
    store.scan()
    assert roundtrip(store)[0]
    store.close()
    assert sorted(p.name for p in outside.iterdir()) == ["notes.txt", "x.kv"]  # nothing deleted or written there
    assert (outside / "notes.txt").read_text() == "keep" and (outside / "x.kv").read_bytes() == b"not a block"
    assert store.folder.is_dir() and not store.folder.is_symlink()


def test_cause9_a_link_under_a_keys_name_is_never_read_through(tmp_path):
    store = DiskStore(str(tmp_path / "kv"), FP, BLOCK)
    assert roundtrip(store)[0]
    target = tmp_path / "elsewhere.kv"
    os.replace(store.path(KEY), target)  # a good file of this folder, moved out, and a link to it put back
    before = target.read_bytes()
    store.path(KEY).symlink_to(target)
    out = np.zeros(BLOCK, dtype=np.uint8)
    store.read(3, KEY, out)
    store.drain(5)
    ((_, ok, why),) = store.completed()
    assert not ok and why.startswith("unreadable"), why
    assert not store.path(KEY).is_symlink() and target.read_bytes() == before  # the link went, its target stayed
    store.close()


def test_a_fifo_under_a_keys_name_never_hangs_the_disk_thread(tmp_path):
    """Opening a FIFO for reading waits for a writer: the disk thread would wait for ever."""
    store = DiskStore(str(tmp_path / "kv"), FP, BLOCK)
    os.mkfifo(store.path(KEY), 0o600)
    out = np.zeros(BLOCK, dtype=np.uint8)
    store.read(3, KEY, out)
    assert store.drain(5)
    ((_, ok, why),) = store.completed()
    assert not ok and why.startswith("unreadable"), why
    assert not store.path(KEY).exists()
    store.close()


# -- cause 10: a folder that cannot be used is one line -------------------------------------------
def _bad_folders(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o1777)  # as /tmp: never made private
    (tmp_path / "home" / "notes").mkdir(parents=True)
    os.chmod(tmp_path / "home", 0o755)  # holds more than the tier: not made private either
    cases = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "kv", "a link": tmp_path / "link",
             "others may write it": tmp_path / "shared", "wider, with other things": tmp_path / "home"}
    if os.geteuid() == 0:
        (tmp_path / "theirs").mkdir()
        os.chown(tmp_path / "theirs", OTHER_UID, OTHER_UID)
        cases["another user's"] = tmp_path / "theirs"
    return cases


def test_cause10_a_folder_that_cannot_be_used_is_one_line_naming_kv_disk_cache_dir(tmp_path):
    for case, path in _bad_folders(tmp_path).items():
        with pytest.raises(ValueError) as err:
            DiskStore(str(path), FP, BLOCK)
        msg = str(err.value)
        assert msg.startswith("kv_disk_cache_dir: ") and str(path) in msg and "\n" not in msg, (case, msg)
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o1777  # refused, not changed
    assert stat.S_IMODE((tmp_path / "home").stat().st_mode) == 0o755 and os.listdir(tmp_path / "home") == ["notes"]


@pytest.mark.slow  # an engine's load
def test_cause10_the_engine_refuses_such_a_folder_in_one_line(default_model_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError) as err:
        LLM(str(default_model_dir), kv_host_cache_bytes=1 << 20, kv_disk_cache_dir=str(tmp_path / "file" / "kv"),
            kv_disk_cache_bytes=1 << 20, **ENGINE)
    msg = str(err.value)
    assert msg.startswith("kv_disk_cache_dir: ") and str(tmp_path / "file") in msg and "\n" not in msg, msg


# -- engines: greedy outputs, tampering, the shared budget, the prompt-recovery attempt ------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("llama-hostile"), seed=5)


def prompts(seed: int, n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=int(rng.integers(40, 70))).tolist() for _ in range(n)]


def generate(llm, batch) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=5, temperature=0))]


def tiers(folder: Path, budget: int = 1 << 20) -> dict:
    return dict(kv_host_cache_bytes=6 * BLOCK_BYTES, kv_disk_cache_dir=str(folder), kv_disk_cache_bytes=budget)


def block_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.kv"))


@pytest.mark.slow  # three engines
def test_cause1_a_forged_file_is_refused_counted_and_computed_again(llama, tmp_path):
    batch = prompts(1)
    plain = LLM(str(llama), **ENGINE)
    expected = generate(plain, batch)
    llm = LLM(str(llama), **tiers(tmp_path), **ENGINE)
    assert generate(llm, batch) == expected
    llm.close()
    files = block_files(tmp_path)
    payloads = [f.read_bytes()[-32 - BLOCK_BYTES:-32] for f in files]
    for i, f in enumerate(files):  # each file gets the next one's KV, sealed as an outsider can
        reseal(f, payloads[(i + 1) % len(payloads)])
    again = LLM(str(llama), **tiers(tmp_path), **ENGINE)
    assert generate(again, batch) == expected  # computed again, right
    disk = again.stats()["kv_tiers"]["disk"]
    assert disk["tampered"] > 0 and disk["bytes_loaded"] == 0, disk
    assert again.stats()["kv_tiers"]["host"]["bytes_loaded"] == 0  # nothing forged reached the cache
    again.close()


@pytest.mark.slow  # three engines
def test_cause8_an_engine_starts_beside_links_and_folders_and_serves_from_disk(llama, tmp_path):
    batch = prompts(2)
    expected = generate(LLM(str(llama), **ENGINE), batch)
    llm = LLM(str(llama), **tiers(tmp_path), **ENGINE)
    generate(llm, batch)
    llm.close()
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    (folder / f"{(b'd' * 32).hex()}.kv").symlink_to(tmp_path / "nowhere")
    (folder / "sub").mkdir()
    (tmp_path / "stray").mkdir()
    again = LLM(str(llama), **tiers(tmp_path), **ENGINE)
    assert generate(again, batch) == expected
    disk = again.stats()["kv_tiers"]["disk"]
    assert disk["unreadable"] == 2 and disk["hits"] > 0 and disk["bytes_loaded"] > 0, disk
    again.close()


@pytest.mark.slow  # four engines
def test_engines_sharing_a_folder_keep_to_one_budget(llama, tmp_path):
    budget = 8 * FILE_BYTES
    plain = LLM(str(llama), **ENGINE)
    a, b = LLM(str(llama), **tiers(tmp_path, budget), **ENGINE), LLM(str(llama), **tiers(tmp_path, budget), **ENGINE)
    batches = {a: prompts(3), b: prompts(4)}
    for llm, batch in batches.items():
        assert generate(llm, batch) == generate(plain, batch)
    sizes = [f.stat().st_size for f in block_files(tmp_path)]
    assert 0 < sum(sizes) <= budget, (len(sizes), budget)
    a.close()
    b.close()  # each may write its cached blocks down at shutdown: still one budget
    sizes = [f.stat().st_size for f in block_files(tmp_path)]
    assert 0 < sum(sizes) <= budget, (len(sizes), budget)
    assert int((tmp_path / ".usage").read_text()) == sum(sizes)
    # And what is there serves, right. Which of b's prompts kept their first blocks on disk depends on
    # when each engine's disk thread wrote (the folder keeps the last ones written): those prompts,
    # served by an engine whose own writes cannot push them out first (a larger budget), load from
    # what they find. (Serving all of b's prompts under the same budget, c's own evictions could
    # delete a later prompt's files before it came: 0 hits in a loaded CI run.)
    on_disk = {bytes.fromhex(f.stem) for f in block_files(tmp_path)}
    leading = {i: leading_on_disk(p, on_disk) for i, p in enumerate(batches[b])}
    kept = [batches[b][i] for i, n in leading.items() if n]
    assert kept, (leading, len(on_disk))  # the shared budget left whole prefixes, not only stray blocks
    c = LLM(str(llama), **tiers(tmp_path, 4 * budget), **ENGINE)
    assert generate(c, kept) == generate(plain, kept)
    # (a load stops where no host slot is left to stage a disk block in: two prompts' claims at once
    # may get fewer than all; the first one's first block always has one)
    assert 0 < c.stats()["kv_tiers"]["disk"]["hits"] <= sum(leading.values()), leading
    c.close()


def leading_on_disk(prompt: list[int], keys: set[bytes]) -> int:
    """How many of prompt's blocks, from its first, have a file (what a lookup of it can load)."""
    hashes = block_hashes(prompt, ENGINE["kv_block_size"], len(prompt) - 1)
    return next((i for i, key in enumerate(hashes) if key not in keys), len(hashes))


def recover_prompt(data: bytes, checkpoint: Path) -> list[int]:
    """The audit's attack: a block file's layer-0 V vectors matched against every vocabulary token's
    (V at layer 0 is the token's normed embedding through v_proj: no position in it)."""
    from safetensors.numpy import load_file
    weights, config = load_file(str(checkpoint / "model.safetensors")), json.loads((checkpoint / "config.json").read_text())
    emb = weights["model.embed_tokens.weight"].astype(np.float64)
    x = emb / np.sqrt((emb ** 2).mean(-1, keepdims=True) + config["rms_norm_eps"])
    table = (x * weights["model.layers.0.input_layernorm.weight"]) @ weights["model.layers.0.self_attn.v_proj.weight"].T
    header = 88 if data[7] == 1 else 80
    block = np.frombuffer(data[header:header + BLOCK_BYTES], np.float32).reshape(2, 2, 16, -1)  # layers, K|V, tokens
    v0 = block[0, 1].astype(np.float64)
    return [int(np.argmin(((table - v) ** 2).sum(-1))) for v in v0]


@ROOT_ONLY
@pytest.mark.slow  # an engine
def test_cause1_the_prompt_recovery_attempt_fails_for_another_user(llama, reachable_dir):
    """As the audit did it: read the tier's files and match their KV against the vocabulary. It
    recovers the prompt from the files' bytes (whoever can read them: the owner, root), and gets no
    byte as another uid."""
    prompt = prompts(5, 1)[0][:50]  # 3 full blocks: 48 tokens on disk at shutdown
    llm = LLM(str(llama), **tiers(reachable_dir / "kv"), **ENGINE)
    generate(llm, [prompt])
    llm.close()
    files = block_files(reachable_dir / "kv")
    blocks = {tuple(prompt[i:i + 16]) for i in range(0, 48, 16)}

    def attempt(uid: int) -> set[tuple[int, ...]]:
        got = [as_user(uid, "cat", str(f)) for f in files]
        return {tuple(recover_prompt(r.stdout, llama)) for r in got if r.returncode == 0}

    assert len(files) == 3 and attempt(0) == blocks  # the attack works on the bytes
    assert attempt(OTHER_UID) == set()  # another user gets none
