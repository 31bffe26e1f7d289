"""Tuning past one GPU and one process, on the simulated GPU (kdagen/simulate.py), CPU only:
study claims on a shared storage (kdagen/claims.py), two tune processes on one journal file and
on one SQLite file, a tune on two GPUs in one process, a worker killed mid-study, a claim left
by a dead process taken over, the storage and device options' errors, the folder lock.

"Measured once" is counted in the simulated GPU's call log (KDAGEN_SIMULATE_LOG): a parallel
run must time every (variant, batch) exactly as often as one process on one GPU does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from typer.testing import CliRunner

from kdagen import devices
from kdagen.claims import FREE, HELD, MINE, RELEASED, STALE, Claims, is_claim
from kdagen.cli import app
from kdagen.schedule import Schedule, duration
from kdagen.serve.variant import PATHS, Variant
from kdagen.simulate import DEFAULT_FAILURES
from kdagen.storage import open_storage
from kdagen.studies import TuneError, folder_lock, make_stamp
from kdagen.tune import TuneOptions, run

ROOT = Path(__file__).resolve().parents[1]
KEY = "commit-h12-q1-i32"
FP = "simulated-h200-sm90-132sm"
BATCHES = (1, 2, 4, 8, 16, 64)
KILLED = f"{KEY}-bulk-t128-v8-r1-pdl"

optuna.logging.set_verbosity(optuna.logging.WARNING)
runner = CliRunner()


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("workloads") / "workloads.yaml"
    batches = ", ".join(map(str, BATCHES))
    path.write_text(f"workloads:\n  - {{name: tiny, heads: 12, window: 1, batches: [{batches}]}}\n")
    return path


def options(workloads: Path, out: Path, **changes: Any) -> TuneOptions:
    """What `kdagen tune --simulate --match KEY --trials 4 --rounds 2` asks."""
    base = TuneOptions(spaces=("commit.yaml",), workloads=workloads, match=KEY, trials=4,
                       rounds=2, out=out, simulate=DEFAULT_FAILURES)  # fmt: skip
    for key, value in changes.items():
        setattr(base, key, value)
    return base


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A simulated host of two GPUs whose workers log every call; returns the log."""
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("KDAGEN_SIMULATE_GPUS", "2")
    monkeypatch.setenv("KDAGEN_SIMULATE_LOG", str(log))
    return log


def calls(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def timings(log: Path) -> Counter[tuple[str, int]]:
    """(variant, batch) -> how many times the GPU timed it."""
    return Counter((c["variant"], c["batch"]) for c in calls(log) if c["method"] == "time")


def table(folder: Path) -> dict[str, Any]:
    """What a tune writes that must not depend on how it was spread: the dispatch table but
    its creation time, and the winners but their wall times."""
    dispatch = json.loads((folder / "dispatch.json").read_text())
    winners = json.loads((folder / "winners.json").read_text())
    return {"dispatch": {k: v for k, v in dispatch.items() if k != "created"},
            "winners": [{k: v for k, v in w.items() if k != "wall_s"} for w in winners]}  # fmt: skip


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, workloads: Path) -> dict[str, Any]:
    """One process, one GPU: its table, its timings and its progress lines."""
    tmp = tmp_path_factory.mktemp("baseline")
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDAGEN_SIMULATE_LOG", str(tmp / "calls.jsonl"))
        run(options(workloads, tmp / "gen"), lines.append)
    return {"table": table(tmp / "gen" / FP), "timings": timings(tmp / "calls.jsonl"),
            "lines": lines}  # fmt: skip


def totals(lines: list[str]) -> str:
    """What the run says it compiled, checked, timed and failed, over all its GPUs."""
    last = next(line for line in reversed(lines) if line.startswith("all "))
    return last.split(": ", 1)[1]


# ---- claims ----


@pytest.fixture(params=["sqlite", "journal"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = "studies.db" if request.param == "sqlite" else "journal.log"
    return f"{request.param}:///{tmp_path / name}"


def test_of_processes_claiming_one_study_at_once_exactly_one_wins(storage_url: str) -> None:
    """Eight claimants, each with a storage of its own (as processes have), start together."""
    open_storage(storage_url)  # the tables exist before the race
    barrier = threading.Barrier(8)
    won: list[bool] = []

    def claim() -> None:
        claims = Claims(open_storage(storage_url), "checkout")
        barrier.wait()
        won.append(claims.acquire("k/b1", None) is not None)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(won) == [False] * 7 + [True]


def test_a_silent_claim_goes_stale_and_its_holder_learns_it_lost_it(storage_url: str) -> None:
    now = [0.0]
    a = Claims(open_storage(storage_url), "checkout", stale_s=10, clock=lambda: now[0])
    b = Claims(open_storage(storage_url), "checkout", stale_s=10, clock=lambda: now[0])
    a.owner |= {"host": "host-a"}  # another host: only its beat tells whether it lives
    held = a.acquire("k/b1", None, "gpu0")
    assert held is not None and a.judge(a.scan()["k/b1"]) == MINE
    assert b.judge(None) == FREE and b.judge(b.scan()["k/b1"]) == HELD
    now[0] = 8.0
    a.beat()  # a beat within the window: the clock starts again
    now[0] = 16.0
    assert b.judge(b.scan()["k/b1"]) == HELD
    assert b.acquire("k/b1", None) is None  # epoch 0 is a's
    now[0] = 30.0  # silent for 14 s
    view = b.scan()["k/b1"]
    assert b.judge(view) == STALE and view.holder.endswith("gpu0")
    taken = b.acquire("k/b1", view, "gpu1")
    assert taken is not None and taken.epoch == 1
    a.beat()
    assert held.lost and "gpu1" in held.lost  # stops its study before its next GPU call
    names = [s.study_name for s in b.storage.get_all_studies() if is_claim(s.study_name)]
    assert names == ["kdagen-claim:k/b1#1"]  # the superseded epoch is deleted
    b.release(taken, "goal")
    view = a.scan()["k/b1"]
    assert a.judge(view) == RELEASED and view.released["done_for"] == "goal"
    slow = Claims(open_storage(storage_url), "checkout", stale_s=100, clock=lambda: now[0])
    slow.owner |= {"host": "host-slow"}
    slow.acquire("k/b2", None)
    now[0] = 60.0
    b.scan()
    now[0] = 90.0  # silent for 30 s: past b's 10 s, within the 100 s the holder beats for
    assert b.judge(b.scan()["k/b2"]) == HELD


def test_a_claim_of_a_dead_process_of_this_host_is_stale_at_once(tmp_path: Path) -> None:
    storage = open_storage(f"sqlite:///{tmp_path / 'studies.db'}")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    gone = Claims(storage, "checkout")
    gone.owner = gone.owner | {"pid": int(dead.stdout), "token": "gone"}
    gone.acquire("k/b1", None)
    live = Claims(storage, "checkout")
    assert live.judge(live.scan()["k/b1"]) == STALE  # no stale_s wait: its pid is gone
    other_host = Claims(storage, "checkout")
    other_host.owner = other_host.owner | {"host": "elsewhere", "token": "far"}
    other_host.acquire("k/b2", None)
    assert live.judge(live.scan()["k/b2"]) == HELD  # a pid of another host says nothing


def test_a_slow_reader_that_recreates_a_deleted_epoch_backs_off(tmp_path: Path) -> None:
    storage = open_storage(f"sqlite:///{tmp_path / 'studies.db'}")
    a, b, slow = (Claims(storage, "checkout", stale_s=0.01) for _ in range(3))
    a.acquire("k/b1", None)
    b.acquire("k/b1", b.scan()["k/b1"])  # takes epoch 1 and deletes epoch 0
    assert slow.acquire("k/b1", None) is None  # read before all that: epoch 0 again, refused
    view = slow.scan()["k/b1"]
    assert view.epoch == 1 and slow.judge(view) != RELEASED


def test_a_live_claim_of_another_checkout_is_a_conflict(tmp_path: Path) -> None:
    storage = open_storage(f"sqlite:///{tmp_path / 'studies.db'}")
    Claims(storage, "old-templates").acquire("k/b1", None, "gpu0")
    ours = Claims(storage, "new-templates")
    why = ours.conflict(ours.scan()["k/b1"])
    assert why and "other kernels" in why and "one checkout per storage" in why
    assert Claims(storage, "old-templates").conflict(ours.scan()["k/b1"]) is None


# ---- one process, several GPUs ----


class HeldCheck:
    """A GPU worker whose check of a variant blocks until the test lets it finish."""

    def __init__(self) -> None:
        self.checks: list[str] = []
        self.entered, self.finish = threading.Event(), threading.Event()

    def call(self, method: str, *args: Any, timeout: float) -> Any:
        assert method == "check"
        self.checks.append(args[0])
        self.entered.set()
        self.finish.wait(30)
        return None


def test_two_gpus_never_check_one_variant_at_once() -> None:
    """The second GPU's study waits for the first one's check of a variant and takes its
    result, rather than checking it again (two studies of a key start with one default)."""
    from kdagen.evaluate import CandidateEvaluator, Ledger, Progress
    from kdagen.simulate import SimulatedCompiler

    ledger, progress, compiler = Ledger(), Progress(lambda line: None), SimulatedCompiler("sm_90a")
    gpus = [HeldCheck(), HeldCheck()]
    evs = [CandidateEvaluator(compiler, g, ledger, progress, 30, 0) for g in gpus]  # type: ignore[arg-type]
    variant = Variant.parse(KILLED)
    ready: list[str | None] = []
    first = threading.Thread(target=lambda: ready.append(evs[0].ready(variant)))
    first.start()
    assert gpus[0].entered.wait(30)
    second = threading.Thread(target=lambda: ready.append(evs[1].ready(variant)))
    second.start()
    second.join(0.5)
    assert second.is_alive() and not gpus[1].checks  # waiting for the first GPU's check
    gpus[0].finish.set()
    first.join(30)
    second.join(30)
    assert ready == [None, None] and gpus[0].checks == [KILLED] and not gpus[1].checks
    assert progress.checked == 1


# ---- several processes, several GPUs ----


def tune_process(workloads: Path, out: Path, storage: str, device: int, log: Path,
                 tmp: Path) -> subprocess.Popen[str]:  # fmt: skip
    """`kdagen tune` in a process of its own on one simulated GPU, as on a host of its own."""
    env = os.environ | {"KDAGEN_SIMULATE_GPUS": "2", "KDAGEN_SIMULATE_LOG": str(log),
                        "KDAGEN_SIMULATE_DELAY": "0.05", "PYTHONPATH": str(ROOT)}  # fmt: skip
    args = [sys.executable, "-m", "kdagen.cli", "tune", "--simulate", "--space", "commit.yaml",
            "--workloads", str(workloads), "--match", KEY, "--trials", "4", "--rounds", "2",
            "--out", str(out), "--storage", storage, "--devices", str(device),
            "--claim-timeout", "20"]  # fmt: skip
    output = open(tmp / f"gpu{device}.out", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_two_tune_processes_on_one_storage_measure_each_study_once(
    kind: str, tmp_path: Path, workloads: Path, baseline: dict[str, Any]
) -> None:
    """Two processes (one GPU each, as two hosts) on one journal file, each writing its own
    folder; and on one SQLite file, sharing the folder. The table is one process's."""
    log = tmp_path / "calls.jsonl"
    storage = f"{kind}:///{tmp_path / ('tune.log' if kind == 'journal' else 'studies.db')}"
    outs = [tmp_path / "host0", tmp_path / "host1"] if kind == "journal" else [tmp_path / "gen"] * 2
    procs = [tune_process(workloads, out, storage, d, log, tmp_path) for d, out in enumerate(outs)]
    for d, proc in enumerate(procs):
        assert proc.wait(timeout=300) == 0, (tmp_path / f"gpu{d}.out").read_text()
    for out in outs:
        assert table(out / FP) == baseline["table"]
    assert timings(log) == baseline["timings"]  # every timing once, as in one process
    by_gpu = Counter(c["gpu"] for c in calls(log) if c["method"] == "time")
    assert set(by_gpu) == {"0", "1"}, by_gpu  # both processes measured studies
    checks = Counter((c["pid"], c["variant"]) for c in calls(log) if c["method"] == "check")
    assert max(checks.values()) == 1  # a process checks a variant once
    said = "".join((tmp_path / f"gpu{d}.out").read_text() for d in range(2))
    assert "Traceback" not in said
    if kind == "sqlite":
        assert len(json.loads((outs[0] / FP / "runs.json").read_text())) == 2


def test_a_tune_on_two_gpus_writes_the_table_of_one(
    simulated: Path, tmp_path: Path, workloads: Path, baseline: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("KDAGEN_SIMULATE_DELAY", "0.02")
    lines: list[str] = []
    result = run(options(workloads, tmp_path / "gen", devices="0,1"), lines.append)
    assert table(result.folder) == baseline["table"]
    assert timings(simulated) == baseline["timings"]
    assert {c["gpu"] for c in calls(simulated) if c["method"] == "time"} == {"0", "1"}
    checks = Counter(c["variant"] for c in calls(simulated) if c["method"] == "check")
    assert set(checks.values()) == {1}  # the GPUs share what they checked, and wait for it
    assert any(" gpu0 " in line for line in lines) and any(" gpu1 " in line for line in lines)
    assert totals(lines) == totals(baseline["lines"])  # the totals count both GPUs' work
    assert f" timed {sum(baseline['timings'].values())} " in totals(lines)  # as the GPUs logged
    assert lines[0].endswith("2 GPUs (gpu0, gpu1); storage sqlite:///"
                             f"{tmp_path / 'gen' / FP / 'studies.db'}")  # fmt: skip


def test_a_killed_worker_is_replaced_and_nothing_is_measured_twice(
    simulated: Path, tmp_path: Path, workloads: Path
) -> None:
    """SIGKILL of a GPU's worker while it times a candidate: that candidate fails (as a worker
    death always has), a new worker carries on, both studies finish."""
    opts = options(workloads, tmp_path / "gen", devices="0,1", exhaustive=True, trials=None,
                   simulate={"kill": [KILLED]}, match=KEY)  # fmt: skip
    opts.workloads = tmp_path / "w.yaml"
    opts.workloads.write_text(
        "workloads:\n  - {name: two, heads: 12, window: 1, batches: [1, 64]}\n"
    )
    result = run(opts, lambda line: None)
    assert sorted(r.batch for r in result.results) == [1, 64]
    assert all(r.final.get("winner") and r.trials == 11 for r in result.results)
    assert all(r.failures == {KILLED: "worker died: signal 9 (SIGKILL) during time"}
               for r in result.results)  # fmt: skip
    log = calls(simulated)
    kills = [i for i, c in enumerate(log) if c["method"] == "time" and c["variant"] == KILLED]
    assert kills
    gpu, pid = log[kills[0]]["gpu"], log[kills[0]]["pid"]
    after = [c for c in log[kills[0] + 1 :] if c["gpu"] == gpu]
    assert after and all(c["pid"] != pid for c in after)  # replaced, and it went on measuring
    measured = timings(simulated)
    for r in result.results:
        for name in r.scored:
            finals = len(r.final["times"].get(name, [])) + (name in r.final["dropped"])
            assert measured[name, r.batch] - finals <= 1, (name, r.batch)  # one trial timing
            if name not in r.failures:
                assert measured[name, r.batch] - finals == 1, (name, r.batch)


def test_a_claim_left_by_a_dead_process_is_taken_over(tmp_path: Path, workloads: Path) -> None:
    """A process on another host died holding b1 with a trial RUNNING: after the claim timeout
    the study is taken over, its RUNNING trial failed (and asked again), and finished."""
    folder = tmp_path / "gen" / FP
    storage = open_storage(f"sqlite:///{folder / 'studies.db'}")
    study = optuna.create_study(study_name=f"{KEY}/b1", storage=storage)
    left = study.ask()
    left.suggest_categorical("path", ["bulk"])
    dead = Claims(storage, make_stamp(FP, list(PATHS)).digest, stale_s=1.0)
    dead.owner = {"host": "elsewhere", "pidns": "", "pid": 4242, "token": "dead"}
    dead.acquire(f"{KEY}/b1", None, "gpu3")  # and never beats
    lines: list[str] = []
    opts = options(workloads, tmp_path / "gen", claim_timeout_s=1.0)
    opts.workloads = tmp_path / "w.yaml"
    opts.workloads.write_text("workloads:\n  - {name: one, heads: 12, window: 1, batches: [1]}\n")
    result = run(opts, lines.append)
    assert f"waiting for 1 study other tune processes hold: {KEY}/b1 (elsewhere:4242 gpu3)" in lines
    assert [r.batch for r in result.results] == [1] and result.results[0].final.get("winner")
    study = optuna.load_study(study_name=f"{KEY}/b1", storage=storage)
    assert study.trials[left.number].state == TrialState.FAIL
    assert study.trials[left.number].user_attrs["status"] == "interrupted"
    claim = next(s for s in storage.get_all_studies() if s.study_name.startswith("kdagen-claim:"
                 f"{KEY}/b1#"))  # fmt: skip
    assert claim.study_name.endswith("#1") and claim.user_attrs["owner"]["pid"] == os.getpid()
    assert claim.user_attrs["released"]["done_for"]


def test_an_interrupt_records_no_failure_and_releases_the_claims(
    tmp_path: Path, workloads: Path
) -> None:
    """Ctrl-C (SIGINT to the process group, workers included) on a tune of two GPUs: exit 130,
    no candidate recorded as failed by it, its claims released (not done)."""
    log = tmp_path / "calls.jsonl"
    env = os.environ | {"KDAGEN_SIMULATE_GPUS": "2", "KDAGEN_SIMULATE_LOG": str(log),
                        "KDAGEN_SIMULATE_DELAY": "0.2", "PYTHONPATH": str(ROOT)}  # fmt: skip
    args = [sys.executable, "-m", "kdagen.cli", "tune", "--simulate", "--space", "commit.yaml",
            "--workloads", str(workloads), "--match", KEY, "--trials", "4", "--rounds", "2",
            "--out", str(tmp_path), "--devices", "0,1"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (log.exists() and len(timings(log)) >= 3) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "kdagen tune: interrupted; run the same command again to resume" in output
    assert "Traceback" not in output
    storage = open_storage(f"sqlite:///{tmp_path / FP / 'studies.db'}")
    names = [s.study_name for s in storage.get_all_studies() if not is_claim(s.study_name)]
    trials = [t for n in names for t in optuna.load_study(study_name=n, storage=storage).trials]
    assert not [t.user_attrs for t in trials if t.user_attrs.get("status") == "failed"]
    claims = [s for s in storage.get_all_studies() if is_claim(s.study_name)]
    assert len(claims) == 2  # one study on each GPU, both released for anyone to take at once
    assert all(s.user_attrs["released"]["done_for"] is None for s in claims)


def test_each_worker_sees_its_own_gpu_and_gpus_of_two_models_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.child_env(1) == {"CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa, 3")  # ours map the index
    assert [devices.child_env(i)["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == ["GPU-aaaa", "3"]
    assert devices.select("all", 2) == [0, 1] and devices.select(" 1 ", 2) == [1]
    h200, h100 = (
        {"fingerprint": "nvidia-h200-sm90-132sm"},
        {"fingerprint": "nvidia-h100-sm90-132sm"},
    )
    assert devices.one_model([h200, h200], [0, 2]) == h200
    with pytest.raises(TuneError, match="gpu0 is nvidia-h200-sm90-132sm, gpu2 is nvidia-h100"):
        devices.one_model([h200, h100], [0, 2])


# ---- the options' errors, the folder lock ----


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--devices", "0,x"], "--devices 0,x: give all or GPU indices such as 0,1"),
        (["--devices", "0,0"], "--devices 0,0: a GPU is named twice"),
        (["--devices", "2"], "--devices 2: no GPU 2; this process sees 1"),
        (["--storage", "studies.db"], "--storage studies.db: not a storage URL; give sqlite:///"),
        (["--storage", "journal:/x.log"], "--storage journal:/x.log: write journal:///PATH"),
        (["--storage", "postgresql://tuner:secret@db.example/kda"],
         "cannot open --storage postgresql://tuner:***@db.example/kda: "),
        (["--storage", "mysql+nodriver://tuner:secret@db.example/kda"],
         "--storage mysql+nodriver://tuner:***@db.example/kda: Can't load plugin"),
    ],
)  # fmt: skip
def test_bad_devices_and_storages_are_one_line_errors(
    args: list[str], says: str, tmp_path: Path, workloads: Path
) -> None:
    result = runner.invoke(app, ["tune", "--simulate", "--space", "commit.yaml", "--workloads",
                                 str(workloads), "--match", KEY, "--out", str(tmp_path), *args])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"kdagen tune: {says}"), result.output
    assert len(result.output.strip().splitlines()) == 1 and "secret" not in result.output


def test_the_folder_lock_excludes_other_processes(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from kdagen.studies import folder_lock\n"
         f"with folder_lock(Path({str(tmp_path)!r})):\n print('held', flush=True); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        refused = pytest.raises(TuneError, match="another kdagen tune is writing")
        with refused, folder_lock(tmp_path, wait=False):
            pass
    finally:
        holder.kill()
        holder.wait()
    with folder_lock(tmp_path, wait=False):
        pass


@pytest.fixture(autouse=True)
def _no_stray_workers() -> Iterator[None]:
    """Every worker a test started is gone when it ends (the tuner closes them)."""
    yield
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name == "kdagen-gpu-worker"]


def test_progress_lines_estimate_the_time_left() -> None:
    """After a few studies run here, each done line says what the rest would take at this
    run's pace (studies left x wall time per study run here), and nothing once none is left."""
    now = [100.0]
    names = [f"key/b{i}" for i in range(10)]
    schedule = Schedule(names, SimpleNamespace(beat_s=5.0), lambda name: "", print,
                        clock=lambda: now[0])  # fmt: skip
    now[0] += 200.0
    assert schedule.time_left(2, 2) == ""  # too few run to tell a pace
    now[0] += 100.0  # 3 studies in 300 s, 7 left
    assert schedule.time_left(3, 3) == ", about 12 min left at this run's pace"
    assert schedule.time_left(6, 3) == ", about 7 min left at this run's pace"  # 3 done elsewhere
    assert schedule.time_left(10, 5) == ""
    assert [duration(s) for s in (45, 119.4, 600, 7199, 9000)] == [
        "45 s", "119 s", "10 min", "120 min", "2.5 h"
    ]  # fmt: skip
