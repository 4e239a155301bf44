"""The credentials of the servers `trainpipe up` starts, without starting them (tests/test_operations.py attacks
the running servers): made once with mode 0600, reused, refused when others could read them, kept off command
lines, and read by the CLI into its environment."""

from __future__ import annotations

import json
import os
import stat

import pytest

from trainpipe.trainer.orchestrate import servers


@pytest.fixture
def no_client_credentials(monkeypatch):
    """None of the variables the CLI sets; whatever it sets is undone after the test (set first, so that
    monkeypatch records them)."""
    for name in ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "PREFECT_API_URL"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_credentials_are_made_once_with_mode_0600_even_under_a_permissive_umask(home):
    old = os.umask(0)  # a umask of 0 would leave a file made with the default mode world-readable
    try:
        made = servers.ensure_credentials()
    finally:
        os.umask(old)
    path = servers.credentials_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["credentials.json"]  # no temporary file left
    user, password = made.prefect_auth_string.split(":", 1)
    assert user == made.mlflow_username == "trainpipe" and len(password) >= 40 and len(made.mlflow_password) >= 40
    assert password != made.mlflow_password
    assert password not in repr(made) and made.mlflow_password not in repr(made)
    assert servers.ensure_credentials() == made == servers.load_credentials()  # reused by a later start


def test_another_home_gets_other_credentials(home, tmp_path, monkeypatch):
    first = servers.ensure_credentials()
    monkeypatch.setenv("TRAINPIPE_HOME", str(tmp_path / "other"))
    assert servers.ensure_credentials().prefect_auth_string != first.prefect_auth_string


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_credentials_file_others_can_read_is_refused_in_one_line(home, mode):
    servers.ensure_credentials()
    servers.credentials_path().chmod(mode)
    with pytest.raises(servers.ServerError, match=f"readable by others \\(mode {mode:o}\\)") as exc:
        servers.load_credentials()
    assert "\n" not in str(exc.value)


def test_a_symlinked_or_foreign_credentials_file_is_refused(home, tmp_path):
    path = servers.credentials_path()
    path.parent.mkdir(parents=True)
    planted = tmp_path / "planted.json"
    planted.write_text("{}")
    planted.chmod(0o600)
    path.symlink_to(planted)
    with pytest.raises(servers.ServerError, match="cannot read the servers' credentials"):
        servers.load_credentials()
    path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, json.dumps({"prefect_auth_string": "a:b"}).encode())
    os.close(fd)
    with pytest.raises(servers.ServerError, match="is not trainpipe's credentials file"):
        servers.load_credentials()


def test_the_servers_get_the_credentials_in_their_environment_never_on_the_command_line(
    home, tiny_profile, monkeypatch
):
    creds = servers.ensure_credentials()
    prefect = servers._prefect_spec(4200, creds)
    mlflow = servers._mlflow_spec(tiny_profile(), 5000, creds)
    secrets = [creds.prefect_auth_string, creds.mlflow_password, creds.mlflow_secret_key]
    for spec in (prefect, mlflow):
        assert not [s for s in secrets if any(s in arg for arg in spec.cmd)]
        assert spec.cmd[spec.cmd.index("--host") + 1] == "127.0.0.1" and spec.state.auth
    assert prefect.env["PREFECT_SERVER_API_AUTH_STRING"] == creds.prefect_auth_string
    assert prefect.env["PREFECT_SERVER_API_HOST"] == "127.0.0.1"
    assert mlflow.cmd[mlflow.cmd.index("--app-name") + 1] == "trainpipe"  # MLflow's basic-auth app, wrapped
    assert mlflow.env["MLFLOW_AUTH_ADMIN_USERNAME"] == creds.mlflow_username
    assert mlflow.env["MLFLOW_AUTH_ADMIN_PASSWORD"] == creds.mlflow_password
    ini = servers.servers_dir() / "mlflow-auth.ini"
    assert mlflow.env["MLFLOW_AUTH_CONFIG_PATH"] == str(ini) and stat.S_IMODE(ini.stat().st_mode) == 0o600
    text = ini.read_text()
    assert f"database_uri = sqlite:///{servers.servers_dir() / 'mlflow-auth.db'}" in text
    assert "default_permission = NO_PERMISSIONS" in text and creds.mlflow_password not in text
    # MLflow reads its cache of verified credentials from it: a request does not hash the password again
    from mlflow.server.auth.config import read_auth_config

    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(ini))
    assert read_auth_config().auth_cache_ttl_seconds == servers.MLFLOW_AUTH_CACHE_S == 60


def test_new_credentials_drop_the_mlflow_users_of_the_old_ones(home):
    servers.servers_dir().mkdir(parents=True)
    (servers.servers_dir() / "mlflow-auth.db").write_text("an admin with a password nobody has any more")
    servers.ensure_credentials()
    assert not (servers.servers_dir() / "mlflow-auth.db").exists()
    (servers.servers_dir() / "mlflow-auth.db").write_text("the admin of these credentials")
    servers.ensure_credentials()  # reused: the user store stays
    assert (servers.servers_dir() / "mlflow-auth.db").exists()


def test_up_refuses_to_keep_a_server_that_runs_without_credentials(home, tiny_profile, monkeypatch):
    legacy = servers.ServerState("prefect", 1, 4200, "http://127.0.0.1:4200", "http://127.0.0.1:4200/api", "", "")
    monkeypatch.setattr(servers, "running", lambda name: legacy if name == "prefect" else None)
    with pytest.raises(servers.ServerError, match="runs without credentials") as exc:
        servers.up(tiny_profile())
    assert "`trainpipe down`" in str(exc.value)
    assert not servers.credentials_path().exists()


def test_up_refuses_running_servers_whose_credentials_are_gone(home, tiny_profile, monkeypatch):
    state = servers.ServerState("mlflow", 1, 5000, "http://127.0.0.1:5000", "http://127.0.0.1:5000", "", "", auth=True)
    monkeypatch.setattr(servers, "running", lambda name: state if name == "mlflow" else None)
    with pytest.raises(servers.ServerError, match=r"credentials .* are gone"):
        servers.up(tiny_profile())
    assert not servers.credentials_path().exists()  # new ones would not match the running server's


def test_the_cli_reads_the_credentials_into_its_environment_unless_it_has_its_own(
    home, no_client_credentials, monkeypatch
):
    from trainpipe.flows.cli import use_running_servers

    creds = servers.ensure_credentials()
    api = "http://127.0.0.1:4200/api"
    state = servers.ServerState("prefect", 1, 4200, "http://127.0.0.1:4200", api, "", "", auth=True)
    monkeypatch.setattr(servers, "running", lambda name: state if name == "prefect" else None)
    use_running_servers()
    assert os.environ["PREFECT_API_URL"] == api
    assert {k: os.environ[k] for k in creds.client_env()} == creds.client_env()

    for name in creds.client_env():
        monkeypatch.delenv(name)
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "mine:own")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "me")  # the user's own MLflow user: ours is not mixed in
    use_running_servers()
    assert os.environ["PREFECT_API_AUTH_STRING"] == "mine:own" and os.environ["MLFLOW_TRACKING_USERNAME"] == "me"
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ


def test_a_prefect_url_set_by_hand_to_the_up_server_gets_its_credentials(home, no_client_credentials, monkeypatch):
    from trainpipe.flows.cli import use_running_servers

    creds = servers.ensure_credentials()
    api = "http://127.0.0.1:4200/api"
    servers.servers_dir().joinpath("prefect.json").write_text(
        json.dumps(
            {"name": "prefect", "pid": 1, "port": 4200, "url": "", "api": api, "health": "", "log": "", "auth": True}
        )
    )
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9999/api")  # another server: none of ours
    use_running_servers()
    assert "PREFECT_API_AUTH_STRING" not in os.environ
    monkeypatch.setenv("PREFECT_API_URL", api + "/")
    use_running_servers()
    assert os.environ["PREFECT_API_AUTH_STRING"] == creds.prefect_auth_string


def test_the_tracking_uri_of_the_up_server_brings_its_user_along(
    home, tiny_profile, no_client_credentials, monkeypatch
):
    profile = tiny_profile()
    creds = servers.ensure_credentials()
    url = "http://127.0.0.1:5000"
    state = servers.ServerState("mlflow", 1, 5000, url, url, "", "", backend=profile.tracking.tracking_uri, auth=True)
    monkeypatch.setattr(servers, "running", lambda name: state if name == "mlflow" else None)
    assert servers.tracking_uri_for(profile) == url
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == creds.mlflow_username
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == creds.mlflow_password
    assert "PREFECT_API_AUTH_STRING" not in os.environ  # only what MLflow needs
