"""Another local user's attacks (docs/security.md, "other local process"), each made as uid ``nobody`` for real:
a shared folder's job files, the servers' databases under TRAINPIPE_HOME."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.other_user import needs_root, run_as_other_user
from trainpipe.trainer.config import load_profile
from trainpipe.trainer.errors import LaunchError

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


@needs_root
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_another_user_can_neither_list_nor_cancel_a_run_on_the_embedded_server(home, tmp_path):
    """`trainpipe run` without `trainpipe up` starts Prefect's embedded server on a loopback port that its command
    line names (``ps``): another user who reads it may reach the port, and is refused every API route."""
    import json
    import subprocess
    import time

    import psutil

    from tests.conftest import BIN, ROOT, TINY

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API") and "AUTH_STRING" not in k}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "TRAINPIPE_HOME": str(home)}
    slow = [*TINY, "train.steps=400", "preflight.enabled=false", "faults.kind=slow", "faults.factor=30"]
    slow += ["faults.rank=1", "faults.attempts=0", "tracking.enabled=false"]
    argv = [str(BIN / "trainpipe"), "run", "--run-name", "embedded", *[a for s in slow for a in ("--set", s)]]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port, deadline = None, time.monotonic() + 180
        while port is None:  # what another user sees in ps: the server's command line and its port
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            for child in psutil.Process(proc.pid).children(recursive=True):
                with __import__("contextlib").suppress(psutil.Error):
                    cmd = child.cmdline()
                    if "uvicorn" in " ".join(cmd) and "--port" in cmd:
                        port = int(cmd[cmd.index("--port") + 1])
            time.sleep(0.2)
        while not list((home / "store" / "runs" / "embedded").glob("checkpoints/step-*/trainpipe.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.3)
        attack = run_as_other_user(
            "import json, urllib.request, urllib.error\n"
            f"api = 'http://127.0.0.1:{port}/api'\n"
            "def call(method, path, body=None):\n"
            "    data = None if body is None else json.dumps(body).encode()\n"
            "    req = urllib.request.Request(api + path, data, {'Content-Type': 'application/json'}, method=method)\n"
            "    try:\n"
            "        return urllib.request.urlopen(req, timeout=10).status\n"
            "    except urllib.error.HTTPError as exc:\n"
            "        return exc.code\n"
            "print(json.dumps([call('GET', '/health'), call('POST', '/flow_runs/filter', {}),\n"
            "    call('POST', '/logs/filter', {}),\n"
            "    call('POST', '/flow_runs/00000000-0000-0000-0000-000000000000/set_state',\n"
            "         {'state': {'type': 'CANCELLING'}, 'force': True})]))\n"
        )
        assert attack.returncode == 0, attack.stderr
        health, listed, logs, cancel = json.loads(attack.stdout)
        assert health == 200 and (listed, logs, cancel) == (401, 401, 401), attack.stdout  # reachable, and refused
        assert proc.poll() is None  # still training
    finally:
        proc.terminate()
        proc.communicate(timeout=120)
    assert stat.S_IMODE((tmp_path / "prefect").stat().st_mode) == 0o700  # its database's folder


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


@needs_root
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_another_user_cannot_reach_a_single_host_jobs_rendezvous_to_run_code_as_its_user(home, tmp_path, scratch):
    """The job's torchrun agent serves its c10d rendezvous store on a port its command line names, and unpickles
    the rendezvous state it reads back there every few seconds: another user writes a pickle of their own into it.
    The job's network is its own (cluster.isolate): the port is not there for them."""
    import subprocess
    import time

    import psutil

    from tests.conftest import BIN, ROOT, TINY, cli_env

    slow = [*TINY, "train.steps=400", "preflight.enabled=false", "faults.kind=slow", "faults.factor=30"]
    slow += ["faults.rank=1", "faults.attempts=0", "tracking.enabled=false", "cluster.warm_host=false"]
    argv = [str(BIN / "trainpipe"), "run", "--run-name", "rdzv", *[a for s in slow for a in ("--set", s)]]
    proc = subprocess.Popen(argv, env=cli_env({"TRAINPIPE_HOME": str(home)}), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    proof = scratch / "pwned"
    try:
        endpoint, deadline = None, time.monotonic() + 180
        while endpoint is None:  # what another user reads in ps: the agent's rendezvous endpoint and run id
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    cmd = child.cmdline()
                    if "--rdzv-endpoint" in cmd:
                        endpoint = cmd[cmd.index("--rdzv-endpoint") + 1], cmd[cmd.index("--rdzv-id") + 1]
            time.sleep(0.2)
        while not list((home / "store" / "runs" / "rdzv").glob("checkpoints/step-*/trainpipe.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.3)
        (host_port, run_id) = endpoint
        attack = run_as_other_user(RENDEZVOUS_ATTACK, host_port.rsplit(":", 1)[1], run_id, str(proof), timeout=60)
        assert attack.returncode == 0, attack.stderr
        time.sleep(8)  # the agent's keep-alive reads the rendezvous state back every 5 s
        assert attack.stdout.startswith("unreachable"), attack.stdout
        assert not proof.exists(), "the job's agent ran the other user's code"
        assert proc.poll() is None  # still training
    finally:
        proc.terminate()
        proc.communicate(timeout=120)
