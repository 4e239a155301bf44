"""``trainpipe``: run the pipeline or one stage. No logic of its own: parse, call a flow, print."""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import math
import os
import signal
import sys
from typing import Any, NoReturn

from trainpipe.flows.automations import HEARTBEAT_S, HEARTBEATS, SILENT_AFTER_S
from trainpipe.trainer.errors import PreflightFailed, ProfileError, RunCancelled, TrainpipeError
from trainpipe.trainer.proc import exit_now, process_started_at


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--profile", default="local", help="Profile name (profiles/NAME.yaml) or path to a YAML file.")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="Override one profile field; repeatable.",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainpipe", description="Fault-tolerant distributed PyTorch training as a Prefect pipeline."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="Run the whole pipeline: shard → preflight → train → validate.")
    _profile_args(run)
    run.add_argument("--run-name", default=None, help="Run name; reusing one resumes that run.")
    run.add_argument("--resume", default=None, metavar="RUN", help="Continue an earlier run; it must exist.")
    run.add_argument("--json", action="store_true", help="Print the run summary as JSON on the last line.")

    up = sub.add_parser("up", help="Start the local Prefect and MLflow servers (trainpipe run then uses them).")
    up.add_argument("-p", "--profile", default="local", help="Profile whose tracking store MLflow serves.")
    up.add_argument("--prefect-port", type=int, default=4200)
    up.add_argument("--mlflow-port", type=int, default=5000)
    sub.add_parser("down", help="Stop the servers `trainpipe up` started.")
    sub.add_parser("status", help="Show whether the local servers are up, with their URLs.")
    store = sub.add_parser("store", help="A local S3 endpoint (moto_server) for the local-s3 profile.")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    store_up = store_sub.add_parser("up", help="Start it with the bucket created; print the environment to export.")
    store_up.add_argument("--port", type=int, default=0, help="Port (default: a free one).")
    store_sub.add_parser("down", help="Stop it; its data is kept in memory only and is gone.")

    auto = sub.add_parser(
        "automations",
        help="Create or replace trainpipe's Prefect automations: notifications (to the webhook in "
        "TRAINPIPE_NOTIFY_URL) and a silent flow run marked Crashed.",
    )
    auto.add_argument(
        "--silent-after",
        type=float,
        default=float(SILENT_AFTER_S),
        metavar="SECONDS",
        help=f"A flow run with no heartbeat (sent every {HEARTBEAT_S} s) for this long is marked Crashed "
        f"(default and least: {SILENT_AFTER_S}).",
    )

    serve = sub.add_parser("serve", help="Serve the on-demand and nightly deployments until interrupted.")
    _profile_args(serve)

    deploy = sub.add_parser(
        "deploy", help="Create on-demand-worker and nightly-worker for a process work pool, with the served form."
    )
    deploy.add_argument("--pool", required=True, help="The process work pool whose workers run them.")
    _profile_args(deploy)

    cmp = sub.add_parser("compare", help="Compare runs: differing params, losses, speed, goodput, and a loss plot.")
    cmp.add_argument("runs", nargs="*", metavar="RUN", help="Run names or MLflow run ids (default: the latest 5).")
    cmp.add_argument("-e", "--experiment", default=None, help="MLflow experiment (default: the profile's).")
    cmp.add_argument("-o", "--out", default=None, help="PNG to draw the loss curves into (none by default).")
    _profile_args(cmp)
    cmp.add_argument("--json", action="store_true")

    shard = sub.add_parser("shard", help="Tokenize and shard the data source.")
    _profile_args(shard)
    shard.add_argument(
        "--verify", action="store_true", help="Hash every file of an existing dataset; rebuild it if one is damaged."
    )
    shard.add_argument("--json", action="store_true")

    pre = sub.add_parser("preflight", help="Check the cluster before training.")
    _profile_args(pre)
    pre.add_argument("--json", action="store_true")

    val = sub.add_parser("validate", help="Validate one checkpoint.")
    val.add_argument("uri", help="Checkpoint URI (…/runs/RUN/checkpoints/step-N).")
    _profile_args(val)
    val.add_argument("--json", action="store_true")

    ck = sub.add_parser("ckpt", help="Inspect checkpoints.")
    ck_sub = ck.add_subparsers(dest="ckpt_command", required=True)
    insp = ck_sub.add_parser("inspect", help="Step, world size, validity and model digest of a checkpoint.")
    insp.add_argument("uri")
    _profile_args(insp)
    insp.add_argument("--json", action="store_true")
    lst = ck_sub.add_parser("list", help="A run's checkpoints with step, time, size and validity.")
    lst.add_argument("run", help="Run name (under the profile's store) or a checkpoints URI.")
    _profile_args(lst)
    lst.add_argument("--json", action="store_true")
    ver = ck_sub.add_parser(
        "verify", help="Prove a run's checkpoints: files, state hashes, the sample ledger, every resume verified."
    )
    ver.add_argument("run", help="Run name (under the profile's store).")
    _profile_args(ver)
    ver.add_argument("--json", action="store_true")

    _models_parser(sub)
    return parser


def _models_parser(sub: Any) -> None:
    """``trainpipe models export | list | promote``: the trained model as people load it."""
    models = sub.add_parser("models", help="The trained model as people load it: list, promote, export.")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    mlist = models_sub.add_parser("list", help="The registered model's versions: aliases, run, val loss, gate.")
    _profile_args(mlist)
    mlist.add_argument("--json", action="store_true")
    promote = models_sub.add_parser(
        "promote", help="Move 'champion' to a version when the gate passes on losses recomputed now."
    )
    promote.add_argument("version", help="The version number to promote.")
    promote.add_argument("--force", action="store_true", help="Move it without the gate (said so on the version).")
    _profile_args(promote)
    promote.add_argument("--json", action="store_true")
    exp = models_sub.add_parser(
        "export", help="A committed checkpoint as a Hugging Face folder (safetensors, config, tokenizer)."
    )
    exp.add_argument("uri", help="Checkpoint URI (…/runs/RUN/checkpoints/step-N).")
    exp.add_argument("-o", "--out", required=True, help="A new folder to write it into.")
    exp.add_argument(
        "--no-state-check",
        action="store_true",
        help="Hash the model's records only, not the whole state against its proof (faster; the weights are "
        "still checked against the recorded model digest).",
    )
    _profile_args(exp)
    exp.add_argument("--json", action="store_true")


def _report(args: argparse.Namespace, text: str, obj: Any) -> None:
    """What a command tells a person on stdout; with ``--json``, the same as one JSON object, alone on stdout (so
    that ``| jq`` reads it), and the text on stderr."""
    if args.json:
        print(text, file=sys.stderr, flush=True)
        _print_json(obj)
    else:
        print(text)


def _print_json(obj: Any) -> None:
    """One line of strict JSON (NaN and inf become null), flushed so it is the last line of stdout."""
    print(json.dumps(_strict(obj), default=str), flush=True)


def _strict(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strict(v) for v in obj]
    return obj


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as an interrupt (Prefect and the job teardown treat both alike)."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def cmd_run(args: argparse.Namespace) -> int:
    from trainpipe.flows.parameters import PipelineParameters
    from trainpipe.trainer.orchestrate.badput import mark_invoked
    from trainpipe.trainer.orchestrate.lease import RunLease
    from trainpipe.trainer.orchestrate.reaper import start_reaper
    from trainpipe.trainer.orchestrate.resolve import hand_over, request_key, resolve, take_over
    from trainpipe.trainer.orchestrate.servers import tracking_uri_for
    from trainpipe.trainer.orchestrate.summary import badput_line
    from trainpipe.trainer.redact import redact_text
    from trainpipe.trainer.store_paths import RunPaths

    params = parameters(
        PipelineParameters,
        profile=args.profile,
        run_name=args.run_name,
        resume=args.resume,
        overrides=args.overrides,
    )
    # Bad input fails here, before Prefect starts; the flow then trains under this name, with what was resolved here.
    values, resume = params.profile_values(), params.resume is not None
    prof, name = resolve(params.profile, params.overrides, params.name, resume=resume, values=values)
    params = params.model_copy(update={"run_name": name})
    RunLease(RunPaths(prof.store.root, name).dir, name, prof.store.storage_options).check_free()
    start_reaper()  # should this process be killed, nothing it started (Prefect's embedded server) runs on
    mark_invoked(process_started_at())  # the run's wall time, and its orchestration, count from here
    signal.signal(signal.SIGTERM, _terminated)  # as Ctrl-C: the job torn down, the MLflow run ended KILLED
    os.environ.update(HEARTBEATS)  # a dead run is marked Crashed (flows/automations.py)
    use_running_servers()
    from prefect.exceptions import CancelledRun

    from trainpipe.flows.pipeline import training_pipeline

    key = request_key(params.model_dump(mode="json"))
    hand_over(key, (prof, name))
    try:
        s = training_pipeline(params=params)
    except CancelledRun as exc:
        raise RunCancelled(
            f"run {name} was cancelled; committed checkpoints are kept and --run-name {name} resumes"
        ) from exc
    finally:
        take_over(key)  # nothing this request resolved stays behind for a later one
    assert isinstance(s, dict)  # the State a cancelled run returns is raised by Prefect's call (above)
    tracking_uri = redact_text(tracking_uri_for(prof))
    where = tracking_uri if tracking_uri.startswith("http") else f"mlflow ui --backend-store-uri {tracking_uri}"
    where = s.get("mlflow_url") or where  # a tracking server: the run's charts
    text = (
        f"\ntrainpipe: run {s['run_name']} finished at step {s['final_step']}, val loss {s['val_loss']:.4f}, "
        f"recoveries {s['recoveries']}, goodput {s['goodput']:.0%}\n"
        f"  time:       {badput_line(s)} of {s['wall_s']:.0f} s\n"
        f"  checkpoint: {s['checkpoint_uri']}\n"
        f"  MLflow:     {where}   (run {s['mlflow_run_id']})"
    )
    published = s.get("published") or {}
    if published.get("model_uri"):
        text += (
            f"\n  model:      {published['line']}\n"
            f"  gate:       {published['gate']}\n"
            f'  load it:    mlflow.pyfunc.load_model("models:/{published["registered_model"]}@'
            f'{"champion" if "champion" in published["aliases"] else "candidate"}")'
        )
    _report(args, text, s)
    return 0


def parameters(model, **values: Any):
    """The flow's parameter model, or one ``error:`` line naming the field (as the Prefect server would refuse it)."""
    from pydantic import ValidationError

    try:
        return model(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "parameters"
        raise ProfileError(f"{field}: {err['msg'].removeprefix('Value error, ')}") from None


def use_running_servers() -> None:
    """Point Prefect at the `trainpipe up` server when it runs (unless PREFECT_API_URL already says where), and
    put the servers' credentials in this process's environment (unless it has its own): Prefect's and MLflow's
    clients read them there, and the flow-run processes, supervisors and ranks this process starts inherit them."""
    from trainpipe.trainer.orchestrate.servers import guard_embedded_server, running, state_of, use_credentials

    url = os.environ.get("PREFECT_API_URL")
    if url:
        state = state_of("prefect")  # the `up` server named by hand (as `trainpipe up` suggests) needs them too
        if state is not None and state.auth and url.rstrip("/") == state.api:
            use_credentials()
        return
    if (prefect := running("prefect")) is not None:
        os.environ["PREFECT_API_URL"] = prefect.api
        if prefect.auth:
            use_credentials()
        print(f"trainpipe: using the Prefect server at {prefect.url} (trainpipe up)", file=sys.stderr)
        return
    guard_embedded_server()


def cmd_up(args: argparse.Namespace) -> int:
    from trainpipe.trainer.orchestrate import servers
    from trainpipe.trainer.profile_files import load_profile

    started = servers.up(load_profile(args.profile, []), args.prefect_port, args.mlflow_port)
    for state in started:
        print(f"{state.name:<8} {state.url}   (pid {state.pid}, log {state.log})")
    prefect = next(s for s in started if s.name == "prefect")
    creds = servers.credentials_path()
    # Where the credentials are, never what they are: this output ends up in terminals, logs and CI records.
    print(f"credentials {creds} (mode 0600; the Prefect UI asks for its prefect_auth_string once)")
    print(
        "trainpipe run, serve and compare now use these servers and credentials; for other Prefect commands: "
        f"export PREFECT_API_URL={prefect.api} and PREFECT_API_AUTH_STRING (prefect_auth_string in that file)"
    )
    use_running_servers()
    from trainpipe.flows.automations import NOTIFY_URL_ENV, ensure_automations
    from trainpipe.trainer.redact import redact_text

    try:
        print(ensure_automations(os.environ.get(NOTIFY_URL_ENV)).line())
    except Exception as exc:  # noqa: BLE001 - the servers are up: that stands; the automations can follow
        first = redact_text(str(exc).splitlines()[0] if str(exc) else "")[:200]
        print(f"trainpipe: automations not created ({type(exc).__name__}: {first}): run `trainpipe automations`",
              file=sys.stderr)  # fmt: skip
    return 0


def cmd_automations(args: argparse.Namespace) -> int:
    if not args.silent_after >= SILENT_AFTER_S:  # fewer than three missed heartbeats would crash live runs
        raise TrainpipeError(
            f"--silent-after {args.silent_after:g} is too short: give at least {SILENT_AFTER_S:g} seconds "
            f"(three heartbeats, {HEARTBEAT_S} s apart)"
        )
    from trainpipe.flows.automations import NOTIFY_URL_ENV, check_notify_url, ensure_automations

    check_notify_url(os.environ.get(NOTIFY_URL_ENV))
    use_running_servers()  # before Prefect is imported: it reads the server's URL then
    if not os.environ.get("PREFECT_API_URL"):
        raise TrainpipeError("automations need a Prefect server: run `trainpipe up` first (or set PREFECT_API_URL)")
    print(ensure_automations(os.environ.get(NOTIFY_URL_ENV), args.silent_after).line())
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from trainpipe.trainer.orchestrate import servers

    stopped = servers.down()
    print(f"stopped: {', '.join(stopped)}" if stopped else "no servers were running")
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    from trainpipe.trainer.orchestrate import servers

    if args.store_command == "down":
        print("stopped the local store; its data is gone" if servers.store_down() else "no local store was running")
        return 0
    state = servers.store_up(args.port)
    print(f"store    {state.url}   (moto_server, pid {state.pid}, data in memory until `trainpipe store down`)")
    print(f"bucket   s3://{servers.STORE_BUCKET}   then: trainpipe run -p local-s3")
    print("export " + " ".join(f"{k}={v}" for k, v in servers.store_env(state).items()))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from trainpipe.trainer.orchestrate import servers

    states = servers.status()
    creds = servers.load_credentials() if any(states.values()) else None
    ok = True
    for name, state in states.items():
        if state is None:
            line, ok = "down", False
        elif not state.auth:
            line, ok = f"up   {state.url}   WITHOUT credentials: `trainpipe down`, then `trainpipe up`", False
        elif creds is None or not servers.accepts_credentials(state, creds):
            line, ok = f"up   {state.url}   but it refuses the credentials in {servers.credentials_path()}", False
        else:
            line = f"up   {state.url}"
        print(f"{name:<8} {line}")
    if creds is not None:
        print(f"credentials {servers.credentials_path()}")
    return 0 if ok else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from trainpipe.trainer.orchestrate.resolve import resolve

    prof, _ = resolve(args.profile, args.overrides, "serve")
    use_running_servers()
    if not os.environ.get("PREFECT_API_URL"):
        raise TrainpipeError("serve needs a Prefect server: run `trainpipe up` first (or set PREFECT_API_URL)")
    # Heartbeats let Prefect tell a flow run whose process died from one that is still training: set, not
    # defaulted, since the silent-run automation's window is three of them (flows/automations.py)
    os.environ.update(HEARTBEATS)
    os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", "1")  # a run triggered from the UI is seen within 1 s
    from trainpipe.flows.deployments import serve_pipeline

    serve_pipeline(prof, args.profile)
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from trainpipe.trainer.orchestrate.resolve import resolve

    prof, _ = resolve(args.profile, args.overrides, "deploy")
    use_running_servers()
    if not os.environ.get("PREFECT_API_URL"):
        raise TrainpipeError("deploy needs a Prefect server: run `trainpipe up` first (or set PREFECT_API_URL)")
    from trainpipe.flows.deployments import deploy_to_pool

    names = deploy_to_pool(prof, args.profile, args.pool)
    print(f"deployed {' and '.join(f'trainpipe/{n}' for n in names)} to work pool {args.pool}: start its worker "
          f"with `prefect worker start --pool {args.pool}` from this checkout's folder")  # fmt: skip
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from trainpipe.trainer.orchestrate.compare import compare_runs, loss_figure
    from trainpipe.trainer.orchestrate.servers import tracking_uri_for
    from trainpipe.trainer.profile_files import load_profile

    prof = load_profile(args.profile, args.overrides)
    uri = tracking_uri_for(prof)
    comparison = compare_runs(uri, args.experiment or prof.tracking.experiment, args.runs)
    out = args.out  # a PNG only where asked for: never one overwritten unasked
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        loss_figure(comparison.runs, "loss: " + ", ".join(r.name for r in comparison.runs)).savefig(out)
    plot = f"loss curves: {out}" if out else "loss curves: -o FILE.png draws them"
    _report(args, f"{comparison.table()}\n\n{comparison.legend()}\n{plot}", {**comparison.as_dict(), "plot": out})
    return 0


def cmd_shard(args: argparse.Namespace) -> int:
    from trainpipe.trainer.orchestrate.resolve import hand_over, request_key, resolve, take_over

    use_running_servers()  # the `up` servers, or the embedded one with a credential of its own
    resolved = resolve(args.profile, args.overrides, "shard")  # bad input: one line before Prefect starts
    key = request_key("shard", args.profile, args.overrides)
    hand_over(key, resolved)
    from trainpipe.flows.stages import shard_flow

    try:
        out = shard_flow(
            profile=args.profile, overrides=args.overrides, progress=sys.stderr.isatty(), verify=args.verify
        )
    finally:
        take_over(key)
    work = out["work"]
    text = (
        f"dataset {out['dataset_id']} at {out['uri']} ({'cache hit' if out['cache_hit'] else 'written'}: "
        f"{work['pieces']} pieces, {work['reused']} found in the store, {work['tokenized_bytes'] / 2**20:.1f} MB "
        f"tokenized in {work['seconds']:.1f} s)"
    )
    _report(args, text, {k: v for k, v in out.items() if k != "manifest"})
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    from trainpipe.trainer.orchestrate.resolve import hand_over, request_key, resolve, take_over

    use_running_servers()  # the `up` servers, or the embedded one with a credential of its own
    resolved = resolve(args.profile, args.overrides, "preflight")  # bad input: one line before Prefect starts
    key = request_key("preflight", args.profile, args.overrides)
    hand_over(key, resolved)
    from trainpipe.flows.stages import preflight_flow
    from trainpipe.trainer.preflight.report import failure_line

    try:
        report = preflight_flow(profile=args.profile, overrides=args.overrides)
    finally:
        take_over(key)
    lines = [f"{c['status']:>4}  {c['name']:<22} {c['detail']}" for c in report["checks"]]
    timings = ", ".join(f"{k} {v:.2f}s" for k, v in report["timings_s"].items())
    _report(args, "\n".join([*lines, f"preflight took {report['duration_s']:.1f}s ({timings})"]), report)
    line = failure_line(report)
    if line:
        raise PreflightFailed(line)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from trainpipe.flows.stages import validate_flow
    from trainpipe.trainer.checkpoint.catalog import inspect_checkpoint
    from trainpipe.trainer.profile_files import load_profile

    use_running_servers()  # the `up` servers, or the embedded one with a credential of its own
    store = load_profile(args.profile, args.overrides).store
    if inspect_checkpoint(args.uri, store.storage_options, verify=False).reason == "does not exist":
        raise TrainpipeError(
            f"checkpoint {args.uri} does not exist; `trainpipe ckpt list RUN` shows a run's checkpoints"
        )
    r = validate_flow(uri=args.uri, profile=args.profile, overrides=args.overrides)
    _report(args, f"valid: {r['uri']} step {r['step']}, val loss {r['val_loss']:.4f}, digest {r['model_digest']}", r)
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
    from trainpipe.trainer.checkpoint import catalog
    from trainpipe.trainer.profile_files import load_profile
    from trainpipe.trainer.store_paths import RunPaths, check_run_name

    store = load_profile(args.profile, args.overrides).store
    if args.ckpt_command == "verify":
        return _verify_run(args, store)
    if args.ckpt_command == "inspect":
        info = catalog.inspect_checkpoint(args.uri, store.storage_options)
        if not info.committed and info.reason == "does not exist":
            raise TrainpipeError(f"checkpoint {args.uri} does not exist")
        if args.json:
            _print_json(info.as_dict())
        else:
            d = info.as_dict()
            print(
                f"{d['uri']}\n  step {d['step']}  world size {d['world_size']}  "
                f"{'valid' if d['valid'] else 'INVALID: ' + d['reason']}\n  model {d['model_factory'] or '-'}  "
                f"digest {d['model_digest']}"
            )
        return 0 if info.valid else 1
    if "/" not in args.run:
        try:
            check_run_name(args.run)
        except ValueError as exc:
            raise ProfileError(f"{exc}; or pass the checkpoints folder's path or URI") from None
    root = args.run if "/" in args.run else RunPaths(store.root, args.run).checkpoints
    infos = [i.as_dict() for i in catalog.list_checkpoints(root, store.storage_options)]
    if not infos:
        raise TrainpipeError(f"no checkpoints under {root}")
    if args.json:
        _print_json(infos)
    else:
        for d in infos:
            status = "valid" if d["valid"] else f"INVALID ({d['reason']})"
            print(f"step {d['step']:>8}  {d['created'] or '-':<25}  {d['size_bytes'] / 1e6:8.2f} MB  {status}")
    return 0


def _verify_run(args: argparse.Namespace, store) -> int:
    """``ckpt verify RUN``: one line saying what the run's checkpoints prove (trainer.checkpoint.chain)."""
    from trainpipe.trainer.checkpoint.chain import verify_run
    from trainpipe.trainer.orchestrate.records import RunRecords
    from trainpipe.trainer.store_paths import RunPaths, check_run_name

    try:
        check_run_name(args.run)
    except ValueError as exc:
        raise ProfileError(str(exc)) from None
    paths = RunPaths(store.root, args.run)
    attempts = RunRecords(store, args.run).attempts()
    report = verify_run(args.run, paths.checkpoints, store.root, store.storage_options, attempts)
    _report(args, report.line(), report.as_dict())
    return 0 if report.holds else 1


def cmd_models(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from trainpipe.trainer.orchestrate.servers import tracking_uri_for
    from trainpipe.trainer.profile_files import load_profile

    profile = load_profile(args.profile, args.overrides)
    profile.tracking.tracking_uri = tracking_uri_for(profile)  # a running `trainpipe up` server serves this store
    if args.models_command == "list":
        return _list_models(args, profile)
    if args.models_command == "promote":
        return _promote_model(args, profile)
    from trainpipe.trainer.export.folder import export_checkpoint

    report = export_checkpoint(args.uri, args.out, profile, check_state=not args.no_state_check)
    _report(
        args,
        f"exported {report.uri} (step {report.step}) to {report.folder} as a {report.model_type} model: "
        f"{report.weight_bytes / 1e6:.1f} MB of weights, digest {report.model_digest[:12]} as recorded"
        + (f", state hash {report.state_hash[:12]} as its proof records" if report.state_hash else ""),
        asdict(report),
    )
    return 0


def _list_models(args: argparse.Namespace, profile) -> int:
    from dataclasses import asdict

    from trainpipe.trainer.orchestrate.registry import Registry

    name = profile.publish.name_for(profile.tracking.experiment)
    versions = Registry(profile.tracking.tracking_uri).versions(name)
    if not versions:
        raise TrainpipeError(f"registered model {name!r} has no versions yet; a run of this profile publishes one")
    _report(args, "\n".join(v.line() for v in versions), [asdict(v) for v in versions])
    return 0


def _promote_model(args: argparse.Namespace, profile) -> int:
    import tempfile
    from dataclasses import asdict
    from pathlib import Path

    from trainpipe.trainer.orchestrate.publish import promote_version

    name = profile.publish.name_for(profile.tracking.experiment)
    with tempfile.TemporaryDirectory(prefix="trainpipe-promote-") as work:
        gate = promote_version(profile, args.version, args.force, Path(work))
    _report(args, f"{name} version {args.version}: {gate.line}", asdict(gate))
    return 0 if gate.promoted else 1


class _ExpectedErrorsWithoutTraceback(logging.Filter):
    """Prefect logs every task/flow failure with its traceback; ours are expected and say what to do."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], TrainpipeError):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_expected_tracebacks() -> None:
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logging.getLogger(name).addFilter(_ExpectedErrorsWithoutTraceback())


# Their parameters (--set among them) are stored in clear by Prefect: a deployment's, or a flow run's.
STARTS_A_FLOW = frozenset({"run", "shard", "preflight", "validate", "serve", "deploy"})
COMMANDS = {
    "run": cmd_run,
    "shard": cmd_shard,
    "preflight": cmd_preflight,
    "validate": cmd_validate,
    "ckpt": cmd_ckpt,
    "models": cmd_models,
    "up": cmd_up,
    "down": cmd_down,
    "status": cmd_status,
    "store": cmd_store,
    "automations": cmd_automations,
    "serve": cmd_serve,
    "deploy": cmd_deploy,
    "compare": cmd_compare,
}


def main() -> NoReturn:
    """The ``trainpipe`` command. Once every exit handler has run (Prefect's log and event flush among them), the
    process ends without the interpreter's teardown of torch, mlflow and Prefect, which took two seconds."""
    code = [1]  # an uncaught exception exits 1
    atexit.register(lambda: exit_now(code[0]))  # registered first, so it runs after every other exit handler
    try:
        code[0] = run_command()
    except SystemExit as exc:  # argparse's own exits: 0 after --help, 2 for a usage error
        code[0] = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        raise
    sys.exit(code[0])


def run_command(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The embedded (ephemeral) Prefect server needs no analytics, and its telemetry races on SQLite.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Its first start migrates a new database: on a small machine that takes longer than Prefect's 20 s default.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    quiet_expected_tracebacks()
    from trainpipe.trainer.profile_files import private_home

    try:
        private_home()  # owner-only before anything is written there: databases, credentials, the local store
        if getattr(args, "overrides", None):  # every command's --set: a command line is every local user's to read
            from trainpipe.flows.parameters import refuse_credentials

            refuse_credentials(args.overrides, stored=args.command in STARTS_A_FLOW)
        return COMMANDS[args.command](args)
    except TrainpipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        print(f"error: {how}; committed checkpoints are kept and the same --run-name resumes", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130


if __name__ == "__main__":
    main()
