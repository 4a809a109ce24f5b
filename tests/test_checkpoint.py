"""Checkpoints: the one-file format and its checksum, atomic and asynchronous saves, the run folder's
last K and fallback, bit-exact resume of the Trainer, and SIGINT/SIGTERM through `kiln train`."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import ml_dtypes
import numpy as np
import pytest

import kiln.checkpoint.format as fmt
from kiln.checkpoint import AsyncSaver, CheckpointError, CheckpointFolder, describe, load, save
from kiln.cli import main
from kiln.train import TrainConfig, Trainer


def stopped_run_folder(full, step: int, dest):
    """dest made into the run folder `full` as it was when stopped after `step`: that checkpoint
    (hard-linked) and the first `step` metrics rows."""
    ck = CheckpointFolder(full / "checkpoints")
    (dest / "checkpoints").mkdir(parents=True)
    os.link(ck.path_for(step), dest / "checkpoints" / ck.path_for(step).name)
    lines = open(full / "metrics.jsonl").read().splitlines()[:step]
    (dest / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return dest

SMALL = dict(model_overrides={"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 32, "dropout": 0.1},
             batch_size=4, device="cpu", progress=False, eval_iters=2, sample_tokens=20)


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def random_state(rng, scale=1):
    """A state tree like a Trainer's: arrays of several dtypes and shapes, JSON leaves, big ints."""
    return {"model": {"w": rng.standard_normal((8 * scale, 5)).astype(np.float32),
                      "b": rng.standard_normal(7),
                      "h": rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16),
                      "ids": rng.integers(-9, 9, (6,)), "mask": rng.random(5) > 0.5,
                      "empty": np.zeros((0, 3), np.float32)},
            "optimizer": {"step": int(rng.integers(1, 1000)), "exp_avg": [rng.standard_normal(4).astype(np.float32)
                                                                          for _ in range(3)],
                          "betas": (0.9, 0.95), "unset": None},
            "rng": {"state": int(rng.integers(2**62)) * 2**64 + 17, "name": "PCG64"},
            "last_loss": float(rng.random()), "nan": float("nan")}


def assert_same(a, b):
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=False)
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b)
    else:
        assert a == b


# ---------------------------------------------------------------------- the file
@pytest.fixture(params=[True, False], ids=["O_DIRECT", "buffered"])
def io_mode(request, monkeypatch):
    """Both ways of moving blocks: O_DIRECT (opt-in, where the filesystem allows it) and plain pwrite/preadv."""
    monkeypatch.setattr(fmt, "DIRECT_IO", request.param and hasattr(os, "O_DIRECT"))
    return request.param


def test_round_trip_is_exact_and_the_file_is_safetensors(tmp_path, io_mode):
    from safetensors.numpy import load_file
    rng, seed = fresh_rng()
    state = random_state(rng)
    info = save(tmp_path / "a.kiln", state)
    back = load(tmp_path / "a.kiln")
    assert_same(state, back)
    assert info["bytes"] == (tmp_path / "a.kiln").stat().st_size
    # any safetensors reader sees the tensors under their paths
    plain = load_file(str(tmp_path / "a.kiln"))
    assert np.array_equal(plain["model/w"], state["model"]["w"]), seed
    assert np.array_equal(plain["optimizer/exp_avg/2"], state["optimizer"]["exp_avg"][2])
    big = {"w": rng.standard_normal(3 * fmt.CHUNK // 4 + 1001).astype(np.float32), "b": rng.standard_normal(3)}
    save(tmp_path / "big.kiln", big)  # several blocks, the last one partial
    assert_same(big, load(tmp_path / "big.kiln"))
    assert (tmp_path / "big.kiln").stat().st_size % fmt.ALIGN == (big["w"].nbytes + 24) % fmt.ALIGN
    d = describe(tmp_path / "a.kiln")
    assert d["format_version"] == fmt.FORMAT_VERSION and d["tensors"]["model/h"] == ("BF16", (3, 4))
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary file was renamed


def test_corruption_at_random_byte_offsets_is_always_detected(tmp_path, io_mode):
    rng, seed = fresh_rng()
    path = tmp_path / "a.kiln"
    save(path, random_state(rng, scale=32_000))  # two blocks
    raw = path.read_bytes()
    bad = tmp_path / "bad.kiln"
    bad.write_bytes(raw)
    _, _, data_start = fmt.read_header(path)
    offsets = np.concatenate([rng.integers(0, 8, 4), rng.integers(8, data_start, 100),
                              rng.integers(data_start, len(raw), 200)])
    with open(bad, "r+b") as f:
        for off in offsets:  # one byte changed at a time, in place
            f.seek(off)
            f.write(bytes([raw[off] ^ int(rng.integers(1, 256))]))
            f.flush()
            with pytest.raises(CheckpointError, match="not a readable kiln checkpoint"):
                load(bad)
            f.seek(off)
            f.write(raw[off:off + 1])
            f.flush()
    assert bad.read_bytes() == raw, seed
    for n in rng.integers(0, len(raw), 60):  # truncated anywhere
        bad.write_bytes(raw[:n])
        with pytest.raises(CheckpointError):
            load(bad)
    bad.write_bytes(raw + b"\0")
    with pytest.raises(CheckpointError, match="trailing bytes"):
        load(bad)


def test_a_checksum_mismatch_names_the_tensor(tmp_path):
    rng, _ = fresh_rng()
    state = random_state(rng, scale=4)
    save(tmp_path / "a.kiln", state)
    table, _, start = fmt.read_header(tmp_path / "a.kiln")
    lo, hi = table["model/w"]["data_offsets"]
    raw = bytearray((tmp_path / "a.kiln").read_bytes())
    raw[start + int(rng.integers(lo, hi))] ^= 0x40
    (tmp_path / "a.kiln").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in 1 data block, the first .*'model/w'"):
        load(tmp_path / "a.kiln")


def test_foreign_and_newer_files_are_refused(tmp_path, monkeypatch):
    from safetensors.numpy import save_file
    save_file({"x": np.ones(3, np.float32)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(CheckpointError, match="no kiln checksum"):
        load(tmp_path / "plain.safetensors")
    (tmp_path / "text.kiln").write_text("hello, not a checkpoint")
    with pytest.raises(CheckpointError, match="header length"):
        load(tmp_path / "text.kiln")
    with pytest.raises(CheckpointError, match="cannot read"):
        load(tmp_path / "missing.kiln")
    monkeypatch.setattr(fmt, "FORMAT_VERSION", 99)
    save(tmp_path / "new.kiln", {"x": np.arange(3.0)})
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="format version 99; this kiln .* reads version 1"):
        load(tmp_path / "new.kiln")
    with pytest.raises(CheckpointError, match="cannot store a set"):
        save(tmp_path / "x.kiln", {"bad": {1, 2}})


def test_a_failure_inside_the_writer_keeps_the_previous_file(tmp_path, monkeypatch):
    import errno
    rng, _ = fresh_rng()
    old = random_state(rng)
    save(tmp_path / "a.kiln", old)
    calls, real = [], fmt._pwrite_all

    def full_disk(fd, view, offset, **kw):
        calls.append(len(view))
        if len(calls) == 3:  # a few blocks in: the disk fills up
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, view, offset, **kw)

    monkeypatch.setattr(fmt, "_pwrite_all", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device .*the file there is unchanged"):
        save(tmp_path / "a.kiln", random_state(rng, scale=200_000))
    monkeypatch.undo()
    assert_same(old, load(tmp_path / "a.kiln"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.kiln"]  # no temporary file left


def _child(code: str, tmp_path, *args):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_full_disk_in_a_real_process_keeps_the_previous_file(tmp_path):
    """The OS refuses the write (RLIMIT_FSIZE: EFBIG, as ENOSPC would), in a child process."""
    rng, _ = fresh_rng()
    old = {"w": rng.standard_normal(1000).astype(np.float32)}
    save(tmp_path / "a.kiln", old)
    child = _child("""
        import resource, signal, sys
        import numpy as np
        from kiln.checkpoint import CheckpointError, save
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        try:
            save(sys.argv[1], {"w": np.ones(1_000_000, np.float32)})
        except CheckpointError as e:
            print(e)
            sys.exit(3)
        """, tmp_path, tmp_path / "a.kiln")
    out, err = child.communicate(timeout=60)
    assert child.returncode == 3, err
    assert "File too large" in out and "the file there is unchanged" in out
    assert_same(old, load(tmp_path / "a.kiln"))
    assert not list(tmp_path.glob(".a.kiln.tmp-*"))


def test_a_save_killed_mid_write_never_tears_the_checkpoint(tmp_path):
    rng, _ = fresh_rng()
    folder = CheckpointFolder(tmp_path / "ck", keep=2)
    folder.prepare()
    old = {"w": rng.standard_normal(5000).astype(np.float32), "step": 1}
    folder.commit(save(folder.path_for(1), old))
    child = _child("""
        import sys, time
        import numpy as np
        import kiln.checkpoint.format as fmt
        real = fmt._pwrite_all
        def slow(fd, view, offset, **kw):
            real(fd, view, offset, **kw)
            print("writing", flush=True)
            time.sleep(60)  # killed here, part-way through the file
        fmt._pwrite_all = slow
        fmt.save(sys.argv[1], {"w": np.ones(4_000_000, np.float32), "step": 2})
        """, tmp_path, folder.path_for(2))
    assert child.stdout.readline().strip() == "writing"
    child.kill()
    child.wait(timeout=30)
    torn = list(folder.folder.glob(".ckpt-*.tmp-*"))
    assert len(torn) == 1 and not folder.path_for(2).exists()
    with pytest.raises(CheckpointError):
        load(torn[0])  # the half-written temporary file is not a checkpoint ...
    state, path = folder.load_latest()  # ... and the run resumes from the previous good one
    assert path == folder.path_for(1) and np.array_equal(state["w"], old["w"])
    folder.prepare()  # the next run's start removes the debris
    assert not list(folder.folder.glob(".ckpt-*.tmp-*"))


# ---------------------------------------------------------------------- asynchronous save
def test_async_save_writes_the_snapshot_not_the_later_values(tmp_path):
    rng, _ = fresh_rng()
    params = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(4)]
    expected = [p.copy() for p in params]
    saver = AsyncSaver()
    stall = saver.save(tmp_path / "a.kiln", {"p": params, "step": 7})
    for p in params:  # the next training step changes the live arrays at once
        p += 1.0
    saver.wait()
    back = load(tmp_path / "a.kiln")
    assert back["step"] == 7 and stall >= 0
    for got, want in zip(back["p"], expected):
        assert np.array_equal(got, want)
    # the staging buffers are reused: a second save snapshots the new values
    saver.save(tmp_path / "b.kiln", {"p": params, "step": 8})
    saver.wait()
    assert np.array_equal(load(tmp_path / "b.kiln")["p"][0], expected[0] + 1.0)


def test_at_most_one_save_in_flight_and_failures_are_reported(tmp_path, monkeypatch):
    import kiln.checkpoint.async_save as asave
    active, peak = [0], [0]

    def slow_save(path, state):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        active[0] -= 1
        return fmt.save(path, state)

    monkeypatch.setattr(asave, "save", slow_save)
    saver = AsyncSaver()
    x = np.random.default_rng().standard_normal(10)
    for i in range(3):
        saver.save(tmp_path / f"{i}.kiln", {"x": x})
    saver.wait()
    assert peak[0] == 1 and all((tmp_path / f"{i}.kiln").is_file() for i in range(3))
    monkeypatch.undo()
    saver.save(tmp_path / "no" / "such" / "dir.kiln", {"x": x})
    saver._thread.join()
    with pytest.raises(CheckpointError, match=r"background save of .*dir.kiln failed"):
        saver.check()
    saver.check()  # reported once


# ---------------------------------------------------------------------- the run folder
def test_keep_last_k_pointer_and_fallback_to_the_previous_good(tmp_path):
    rng, _ = fresh_rng()
    folder = CheckpointFolder(tmp_path, keep=2)
    folder.prepare()
    states = {}
    for step in range(1, 6):
        states[step] = {"w": rng.standard_normal(50).astype(np.float32), "step": step}
        folder.commit(save(folder.path_for(step), states[step]))
    assert [s for s, _ in folder.checkpoints()] == [4, 5]
    assert folder.pointer()["file"] == "ckpt-00000005.kiln" and folder.pointer()["step"] == 5
    raw = bytearray(folder.path_for(5).read_bytes())
    raw[-3] ^= 0xFF
    folder.path_for(5).write_bytes(bytes(raw))
    reports = []
    state, path = folder.load_latest(report=reports.append)
    assert path == folder.path_for(4) and np.array_equal(state["w"], states[4]["w"])
    assert "ckpt-00000005.kiln" in reports[0] and "checksum mismatch" in reports[0]
    folder.path_for(4).write_bytes(b"")
    with pytest.raises(CheckpointError, match="no good checkpoint.*ckpt-00000005.*ckpt-00000004"):
        folder.load_latest(report=reports.append)
    with pytest.raises(CheckpointError, match="holds no checkpoints"):
        CheckpointFolder(tmp_path / "empty").load_latest()
    with pytest.raises(CheckpointError, match="keep_checkpoints must be an integer >= 1, got 0"):
        CheckpointFolder(tmp_path, keep=0)


# ---------------------------------------------------------------------- the Trainer
def _losses(run_dir):
    return [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.mark.parametrize("async_checkpoint", [True, False])
def test_resume_is_bit_exact(tmp_path, async_checkpoint):
    """Stop at step 4 of 10 (dropout on, 2 micro-batches, evaluations at 3, before the checkpoint, and
    at 6 and 9 after it, as tests/test_data_staging_cuda.py's run on the GPU), resume: the same losses,
    bit for bit."""
    cfg = dict(SMALL, max_steps=10, eval_interval=3, grad_accum=2, checkpoint_interval=4,
               async_checkpoint=async_checkpoint, out_dir=str(tmp_path))
    full = Trainer(TrainConfig(**cfg, run_name="full")).fit()
    ck = CheckpointFolder(tmp_path / "full" / "checkpoints")
    assert [s for s, _ in ck.checkpoints()] == [4, 8, 10]
    stopped = stopped_run_folder(tmp_path / "full", 4, tmp_path / "stopped")
    resumed = Trainer.from_checkpoint(stopped)
    assert resumed.step == 4 and resumed.optimizer.step_count == 4
    again = resumed.fit()
    assert _losses(stopped) == _losses(tmp_path / "full")
    assert again["final_val_loss"] == full["final_val_loss"] and again["sample"] == full["sample"]
    a, b = load(ck.path_for(10)), load(CheckpointFolder(stopped / "checkpoints").path_for(10))
    for name in a["model"]:
        assert np.array_equal(a["model"][name], b["model"][name]), name
    for i, m in enumerate(a["optimizer"]["exp_avg_sq"]):
        assert np.array_equal(m, b["optimizer"]["exp_avg_sq"][i])
    assert a["loaders"] == b["loaders"] and a["rng"] == b["rng"] and a["epoch"] == b["epoch"]


def test_the_rng_state_is_what_makes_it_exact(tmp_path):
    """Control: restoring everything but the dropout RNG gives other losses."""
    from kiln.random import default_generator
    cfg = dict(SMALL, max_steps=6, eval_interval=6, checkpoint_interval=3, out_dir=str(tmp_path))
    Trainer(TrainConfig(**cfg, run_name="full")).fit()
    state = load(CheckpointFolder(tmp_path / "full" / "checkpoints").path_for(3))
    t = Trainer(TrainConfig(**cfg, run_name="x"))
    t.load_state_dict(state)
    default_generator("cpu").manual_seed(12345)
    t.train_step()
    assert t.last_loss != _losses(tmp_path / "full")[3]
    t.load_state_dict(state)
    t.train_step()
    assert t.last_loss == _losses(tmp_path / "full")[3]


def test_a_corrupt_newest_checkpoint_resumes_from_the_previous_good(tmp_path, capsys):
    cfg = dict(SMALL, max_steps=6, eval_interval=6, checkpoint_interval=2, out_dir=str(tmp_path))
    Trainer(TrainConfig(**cfg, run_name="r")).fit()
    ck = CheckpointFolder(tmp_path / "r" / "checkpoints")
    reference = _losses(tmp_path / "r")
    raw = bytearray(ck.path_for(6).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    ck.path_for(6).write_bytes(bytes(raw))
    t = Trainer.from_checkpoint(tmp_path / "r")
    assert "ckpt-00000006.kiln" in capsys.readouterr().err and t.step == 4
    t.fit()
    assert _losses(tmp_path / "r") == reference
    assert ck.path_for(4).is_file() and load(ck.path_for(6))["step"] == 6  # rewritten, good again


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    cfg = dict(SMALL, max_steps=2, eval_interval=2, out_dir=str(tmp_path))
    Trainer(TrainConfig(**cfg, run_name="r")).fit()
    state = load(CheckpointFolder(tmp_path / "r" / "checkpoints").path_for(2))
    other = Trainer(TrainConfig(**dict(cfg, model_overrides={**SMALL["model_overrides"], "n_layer": 1})))
    with pytest.raises(CheckpointError, match=r"does not match this model: \{'n_layer': \(2, 1\)\}"):
        other.load_state_dict(state)
    with pytest.raises(CheckpointError, match="not a Trainer checkpoint"):
        other.load_state_dict({"w": 1})


def test_a_failed_background_save_stops_training_with_the_reason(tmp_path, monkeypatch):
    import kiln.checkpoint.async_save as asave

    def failing(path, state):
        raise CheckpointError(f"could not write {path}: No space left on device (errno 28)")

    monkeypatch.setattr(asave, "save", failing)
    cfg = dict(SMALL, max_steps=6, eval_interval=6, checkpoint_interval=2, out_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match=r"background save of .*ckpt-00000002.kiln failed.*No space left"):
        Trainer(TrainConfig(**cfg, run_name="r")).fit()


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_finishes_the_step_saves_and_resume_continues_exactly(tmp_path, sig, code):
    # constant lr (min_lr = lr, no warm-up): the schedule does not depend on max_steps, so a run
    # stopped at step k and resumed to k + 5 must equal an uninterrupted run of k + 5 steps
    args = ["--device", "cpu", "--batch-size", "4", "--seq-len", "32", "--set", "n_layer=1",
            "--set", "n_embd=32", "--set", "dropout=0.1", "--lr", "1e-3", "--min-lr", "1e-3",
            "--warmup-steps", "0", "--eval-interval", "100000", "--no-progress"]
    run = tmp_path / "r"
    child = subprocess.Popen([sys.executable, "-m", "kiln.cli", "train", *args, "--steps", "1000000",
                              "--out", str(tmp_path), "--name", "r"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (
            (run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 5):
        time.sleep(0.02)
    child.send_signal(sig)
    out, err = child.communicate(timeout=60)
    assert child.returncode == code, err
    k = len(_losses(run))
    assert f"stopped by {sig.name} after step {k}" in err and "--resume" in err and "Traceback" not in err
    folder = CheckpointFolder(run / "checkpoints")
    assert [s for s, _ in folder.checkpoints()] == [k] and folder.pointer()["step"] == k
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "train", "--resume", str(run),
                           "--steps", str(k + 5), "--no-progress"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"resuming {run} at step {k}" in done.stdout
    reference = dict(SMALL, model_overrides={"n_layer": 1, "n_embd": 32, "dropout": 0.1}, seq_len=32,
                     lr=1e-3, min_lr=1e-3, warmup_steps=0, eval_interval=100000, eval_iters=20,
                     sample_tokens=300, max_steps=k + 5, out_dir=str(tmp_path), run_name="ref")
    Trainer(TrainConfig(**reference)).fit()
    assert len(_losses(run)) == k + 5
    assert _losses(run) == _losses(tmp_path / "ref")


def test_cli_resume_bad_input_exits_2(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "no " in capsys.readouterr().err
    Trainer(TrainConfig(**dict(SMALL, max_steps=1, eval_interval=1, out_dir=str(tmp_path), run_name="r"))).fit()
    assert main(["train", "--resume", str(tmp_path / "r"), "--set", "n_layer=3"]) == 2
    assert "keeps its checkpoint's model" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "r"), "--lr", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "['lr'] cannot change" in err and "max_steps" in err
    assert main(["train", "--checkpoint-interval", "-1", "--out", str(tmp_path / "x")]) == 2
    assert "checkpoint_interval must be an integer >= 0" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("kiln").cuda_is_available(), reason="needs an NVIDIA GPU with CuPy")
def test_resume_moves_between_cpu_and_cuda(tmp_path):
    """A run checkpointed on one device continues on the other (dropout off: RNGs differ by device)."""
    import shutil
    base = dict(SMALL, model_overrides={**SMALL["model_overrides"], "dropout": 0.0}, max_steps=6,
                eval_interval=6, checkpoint_interval=3, out_dir=str(tmp_path))
    for first, then in (("cuda", "cpu"), ("cpu", "cuda")):
        Trainer(TrainConfig(**dict(base, device=first), run_name=first)).fit()  # async: pinned snapshot on cuda
        ref = _losses(tmp_path / first)
        moved = tmp_path / f"{first}-to-{then}"
        shutil.copytree(tmp_path / first, moved)
        for p in CheckpointFolder(moved / "checkpoints").checkpoints()[1:]:
            p[1].unlink()
        (moved / "checkpoints" / "latest.json").unlink()
        t = Trainer.from_checkpoint(moved, device=then)
        assert t.step == 3 and str(t.device).startswith(then)
        t.fit()
        np.testing.assert_allclose(_losses(moved)[3:], ref[3:], rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("kiln").cuda_is_available(), reason="needs an NVIDIA GPU with CuPy")
def test_async_save_of_device_arrays_writes_the_snapshot_without_a_host_wait(tmp_path):
    """Device arrays go to pinned memory on a side stream; kiln's stream waits for those copies on
    the GPU, so a kernel queued right after the save (the next step) cannot change what is written."""
    import kiln
    gpu = kiln.device("cuda").backend
    rng, _ = fresh_rng()
    host = [rng.standard_normal((1024, 1024)).astype(np.float32) for _ in range(8)]
    params = [gpu.asarray(p) for p in host]
    saver = AsyncSaver()
    for name in ("a", "b"):  # the second save reuses the pinned buffers
        saver.save(tmp_path / f"{name}.kiln", {"p": params, "step": 7})
        for p in params:  # queued at once on kiln's stream, as the next step's AdamW would be
            p *= 3.0
        saver.wait()
        back = load(tmp_path / f"{name}.kiln")
        for got, want in zip(back["p"], host):
            assert np.array_equal(got, want)
        host = [h * np.float32(3.0) for h in host]
    assert np.array_equal(gpu.to_numpy(params[0]), host[0])
