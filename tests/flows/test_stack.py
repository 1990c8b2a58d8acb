"""The local platform end to end: ``capflow stack up`` (moto S3 + MLflow server + Prefect server + worker, all on
127.0.0.1), a CLI pipeline run whose artifacts land in the bucket, ``capflow deploy`` + ``prefect deployment run``
executed by the worker (a nightly re-run with nothing changed retrains nothing), the UIs rendered by headless
Chromium, ``capflow caption`` with the champion from the registry, S3 faults (transient -> retried; dead -> the run
fails loudly, checkpoints stay, the re-run resumes), and ``capflow stack down`` leaving no process or port behind.

The tests share one stack and run in file order (each step builds on the previous one's state)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from mlflow import MlflowClient

from flows.stack import HOST, Stack, port_free

pytestmark = [pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]
CAPFLOW = [sys.executable, "-m", "flows.cli"]
PREFECT = str(Path(sys.executable).parent / "prefect")
SHOTS = Path(os.environ.get("CAPFLOW_TEST_ARTIFACTS", REPO / "test-artifacts")) / "screenshots"
RUN_ARGS = ["--preset", "tiny", "--students", "lw", "--no-scst"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Env:
    def __init__(self, home: Path, work: Path):
        self.home, self.work = home, work
        self.stack: Stack | None = None

    def env(self) -> dict[str, str]:
        e = dict(os.environ)
        e.update(self.stack.client_env())
        e.update({"PREFECT_HOME": str(self.work / "prefect-client"), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                  "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "PYTHONUNBUFFERED": "1"})
        return e

    def capflow(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([*CAPFLOW, *args], cwd=self.work, env=self.env(), capture_output=True, text=True,
                           timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"capflow {' '.join(args)} -> {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
        return p

    def client(self) -> MlflowClient:
        return MlflowClient(self.stack.mlflow_url)


@pytest.fixture(scope="module")
def plat(tmp_path_factory):
    home, work = tmp_path_factory.mktemp("stack"), tmp_path_factory.mktemp("work")
    (work / "prefect-client").mkdir()
    e = Env(home, work)
    ports = {"s3": _free_port(), "mlflow": _free_port(), "prefect": _free_port()}
    p = subprocess.run([*CAPFLOW, "stack", "up", "--home", str(home), "--s3-port", str(ports["s3"]),
                        "--mlflow-port", str(ports["mlflow"]), "--prefect-port", str(ports["prefect"]),
                        "--bucket", "capflow-test", "--json"], capture_output=True, text=True, timeout=300, cwd=work)
    assert p.returncode == 0, p.stderr[-4000:]
    e.stack = Stack.load(home)
    yield e
    if any(psutil.pid_exists(pid) for pid in e.stack.pids.values()):  # a failed test left it up
        subprocess.run([*CAPFLOW, "stack", "down", "--home", str(home)], timeout=120, capture_output=True)


def _stack_processes(st: Stack) -> list[psutil.Process]:
    procs = []
    for pid in st.pids.values():
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return procs


def test_stack_up_status_env_and_only_loopback(plat):
    st = plat.stack
    p = plat.capflow("stack", "status", "--home", str(plat.home), "--json")
    s = json.loads(p.stdout)
    assert s["running"] is True
    assert s["prefect_api"] == f"http://127.0.0.1:{st.ports['prefect']}/api"
    assert s["mlflow"] == f"http://127.0.0.1:{st.ports['mlflow']}"
    assert s["s3_endpoint"] == f"http://127.0.0.1:{st.ports['s3']}" and s["bucket"] == "capflow-test"
    env = plat.capflow("stack", "env", "--home", str(plat.home)).stdout
    exports = dict(line.removeprefix("export ").split("=", 1) for line in env.splitlines())
    assert exports["PREFECT_API_URL"] == s["prefect_api"] and exports["MLFLOW_TRACKING_URI"] == s["mlflow"]
    assert exports["AWS_ENDPOINT_URL_S3"] == s["s3_endpoint"]
    # every listening socket of every stack process (and their children) is on the loopback address
    listening = [c for p in _stack_processes(st) for c in p.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert {c.laddr.port for c in listening} >= set(st.ports.values())
    assert {c.laddr.ip for c in listening} == {"127.0.0.1"}
    assert (plat.home / "stack.json").stat().st_mode & 0o077 == 0  # holds the local endpoint's credentials
    # a second `up` on a running stack is a no-op; another stack on a taken port says so and starts nothing
    again = plat.capflow("stack", "up", "--home", str(plat.home), "--json")
    assert json.loads(again.stdout)["services"]["mlflow"]["pid"] == st.pids["mlflow"]
    other = plat.work / "other-stack"
    clash = plat.capflow("stack", "up", "--home", str(other), "--mlflow-port", str(st.ports["mlflow"]),
                         "--s3-port", str(_free_port()), "--prefect-port", str(_free_port()), check=False)
    assert clash.returncode == 2 and f"mlflow port {st.ports['mlflow']}" in clash.stderr
    assert not (other / "logs").exists()


def test_cli_run_lands_every_artifact_in_the_bucket(plat):
    p = plat.capflow("run", *RUN_ARGS, "--json")
    res = json.loads(p.stdout)
    assert res["tracking_uri"] == plat.stack.mlflow_url and res["failed"] == []
    keys = set(plat.stack.objects("mlflow/"))
    client = plat.client()
    runs = client.search_runs([res["experiment_id"]], max_results=200)
    assert len(runs) >= 8
    for r in runs:  # every artifact of every run of the pipeline is an object in the bucket
        assert r.info.artifact_uri.startswith("mlflow-artifacts:/")
        listed = _artifact_files(client, r.info.run_id)
        prefix = f"mlflow/{res['experiment_id']}/{r.info.run_id}/artifacts/"
        assert {prefix + f for f in listed} <= keys, r.data.tags.get("mlflow.runName")
    parent = prefix_of(res)
    for name in ("config.yaml", "leaderboard.json", "leaderboard.md", "leaderboard.png", "promotion.json"):
        assert parent + name in keys
    body = plat.stack.s3_client().get_object(Bucket="capflow-test", Key=parent + "leaderboard.json")["Body"].read()
    assert json.loads(body)["leaderboard"][0]["student"] == "lw"
    student = next(r for r in runs if r.data.tags.get("mlflow.runName") == "lw-1x")
    # the student's MLflow Model (a LoggedModel of its run): MLmodel, model code, the capflow folder, in the bucket
    (output,) = student.outputs.model_outputs
    model_dir = f"mlflow/{res['experiment_id']}/models/{output.model_id}/artifacts/"
    model_keys = {k[len(model_dir):] for k in keys if k.startswith(model_dir)}
    assert {"MLmodel", "pyfunc_captioner.py", "requirements.txt", "artifacts/model/model.pt",
            "artifacts/model/vocab.json", "artifacts/model/capflow.json"} <= model_keys
    assert client.get_model_version_by_alias("capflow-captioner", "champion").run_id == student.info.run_id
    plat.first = res


def prefix_of(res) -> str:
    return f"mlflow/{res['experiment_id']}/{res['mlflow_run_id']}/artifacts/"


def _artifact_files(client: MlflowClient, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for f in client.list_artifacts(run_id, path):
        out += _artifact_files(client, run_id, f.path) if f.is_dir else [f.path]
    return out


def test_deploy_then_deployment_run_executes_on_the_worker(plat):
    p = plat.capflow("deploy", *RUN_ARGS, "--cron", "0 2 * * *", "--timezone", "Europe/Berlin", "--json")
    dep = json.loads(p.stdout)
    api = httpx.Client(base_url=plat.stack.prefect_api, timeout=30)
    d = api.get("/deployments/name/capflow-pipeline/nightly").raise_for_status().json()
    assert [(s["schedule"]["cron"], s["schedule"]["timezone"], s["active"]) for s in d["schedules"]] == \
        [("0 2 * * *", "Europe/Berlin", True)]
    assert d["global_concurrency_limit"]["limit"] == 1
    assert d["work_pool_name"] == "capflow" and d["entrypoint"] == "flows.pipeline.pipeline"
    assert set(d["parameter_openapi_schema"]["properties"]) == {"preset", "config_path", "overrides", "students",
                                                               "scst"}
    assert d["parameters"] == {"preset": "tiny", "students": ["lw"], "scst": False}
    assert dep["deployment_id"] == d["id"]
    # the UI's "Run" button = this CLI; the stack's worker picks the run up
    run = subprocess.run([PREFECT, "deployment", "run", "capflow-pipeline/nightly", "--watch", "--watch-timeout",
                          "540"], env=plat.env(), capture_output=True, text=True, timeout=600, cwd=plat.work)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    every = api.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [d["id"]]}}}).raise_for_status().json()
    runs = [r for r in every if r["state"]["type"] != "SCHEDULED"]
    assert len(runs) == 1 and runs[0]["state"]["type"] == "COMPLETED"
    # the nightly runs the server's scheduler made of the cron: 02:00 in Berlin
    nightly = [r["expected_start_time"] for r in every if r["state"]["type"] == "SCHEDULED"]
    assert all(t.endswith(("T01:00:00Z", "T00:00:00Z")) for t in nightly), nightly
    fr = runs[0]
    plat.flow_run_name = fr["name"]
    # the nightly run saw no new data and no changed settings: every stage came from the cache,
    # the champion stayed, and the parent run records that
    client = plat.client()
    parent = client.search_runs([plat.first["experiment_id"]],
                                filter_string=f"tags.`prefect.flow_run_id` = '{fr['id']}'")[0]
    stages = {k.removeprefix("stage."): v.split(":")[0] for k, v in parent.data.tags.items()
              if k.startswith("stage.")}
    assert stages and set(stages.values()) == {"cached"}, stages
    promo = json.loads(plat.stack.s3_client().get_object(
        Bucket="capflow-test", Key=f"mlflow/{parent.info.experiment_id}/{parent.info.run_id}/artifacts/promotion.json"
    )["Body"].read())
    assert promo["changed"] is False
    assert client.get_model_version_by_alias("capflow-captioner", "champion").version == \
        plat.first["champion"]["version"]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _browser(url: str, png: Path) -> str:
    """Screenshot ``url`` into ``png`` and return the rendered DOM (ENVIRONMENT.md's headless flags)."""
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--virtual-time-budget=20000", "--window-size=1400,1200"]
    profile = png.parent / f".profile-{png.stem}"
    subprocess.run([*base, f"--user-data-dir={profile}-s", f"--screenshot={png}", url], capture_output=True,
                   timeout=120, check=True)
    dom = subprocess.run([*base, f"--user-data-dir={profile}-d", "--dump-dom", url], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    png.with_suffix(".html").write_text(dom, encoding="utf-8")  # kept beside the screenshot
    shutil.rmtree(f"{profile}-s", ignore_errors=True)
    shutil.rmtree(f"{profile}-d", ignore_errors=True)
    assert png.stat().st_size > 20_000  # a rendered page, not a blank one
    return dom


def _text(dom: str) -> str:
    """A rendered page's visible text, whitespace collapsed."""
    import html
    import re

    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom))).replace("\xa0", " ").replace("  ", " ")


def test_prefect_and_mlflow_uis_render_the_runs(plat):
    if _chromium() is None:
        pytest.skip("chromium is not installed (make test installs it with apt-get when run as root)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    st = plat.stack
    runs_page = _browser(f"{st.prefect_ui}/runs", SHOTS / "prefect-flow-runs.png")
    assert plat.flow_run_name in runs_page and "capflow-pipeline" in runs_page
    deps = _browser(f"{st.prefect_ui}/deployments", SHOTS / "prefect-deployments.png")
    assert "nightly" in deps and "At 02:00 AM" in deps
    exp = plat.first["experiment_id"]
    exp_page = _browser(f"{st.mlflow_url}/#/experiments/{exp}/runs", SHOTS / "mlflow-experiment-runs.png")
    assert "pipeline" in exp_page and "capflow-tiny" in exp_page
    student = plat.client().search_runs([exp], filter_string="tags.`mlflow.runName` = 'lw-1x'")[0]
    run_page = _browser(f"{st.mlflow_url}/#/experiments/{exp}/runs/{student.info.run_id}",
                        SHOTS / "mlflow-student-run.png")
    assert "lw-1x" in run_page and "test_CIDEr" in run_page and "xe_best_val_CIDEr" in run_page
    # the registered champion's version page and its LoggedModel's page: alias, metrics, the linked dataset
    client = plat.client()
    champ = client.get_model_version_by_alias("capflow-captioner", "champion")
    version_page = _browser(f"{st.mlflow_url}/#/models/capflow-captioner/versions/{champ.version}",
                            SHOTS / "mlflow-model-version.png")
    shown = _text(version_page)
    assert f"capflow-captioner Version {champ.version}" in shown and "Aliases : @ champion" in shown
    assert "Source Run : lw-1x" in shown
    model_id = champ.source.removeprefix("models:/")
    model = client.get_logged_model(model_id)
    model_page = _browser(f"{st.mlflow_url}/#/experiments/{exp}/models/{model_id}", SHOTS / "mlflow-logged-model.png")
    shown = _text(model_page)
    assert model.name in shown and model_id in shown
    (linked,) = {m.dataset_digest for m in model.metrics if m.key == "test_CIDEr"}
    assert f"test_CIDEr dataset (#{linked[:16]}" in shown  # the metric, measured on the linked dataset


def _shows(page, *wanted: str, timeout: float = 60) -> str:
    """The page's text once it shows every one of ``wanted`` (MLflow's UI renders after load and keeps polling)."""
    deadline = time.monotonic() + timeout
    while True:
        text = page.inner_text("body")
        if all(w in text for w in wanted):
            return text
        assert time.monotonic() < deadline, f"missing {[w for w in wanted if w not in text]}: {text[-1500:]}"
        page.wait_for_timeout(1000)


def _wait_for_state(page, read, timeout: float) -> None:
    """Until the flow run ``read()`` is final (reloading its page meanwhile); it must have completed, and its page's
    header must say so."""
    deadline = time.monotonic() + timeout
    while (run := read())["state"]["type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        assert time.monotonic() < deadline, f"the run is still {run['state']['type']} after {timeout:.0f} s"
        page.wait_for_timeout(5000)
        page.reload(wait_until="networkidle")
    assert run["state"]["type"] == "COMPLETED", run["state"]
    page.reload(wait_until="networkidle")
    page.wait_for_timeout(2000)
    header = page.inner_text("body").split("Logs\n", 1)[0]  # the run's title block, above its tabs
    assert run["name"] in header and "Completed" in header and "Running" not in header, header[-800:]


def test_a_run_started_by_a_click_in_the_prefect_ui_completes_and_its_lineage_shows_in_mlflow(plat):
    """The interaction the users name first, as a person does it in a real (headless) Chromium: open the nightly
    deployment (its cron schedule and next run shown), press Run -> Custom run, fill the form (run name, preset,
    one student, no SCST, an override), submit; the stack's worker runs it and the UI shows it Completed with its
    "capflow run summary" artifact; then MLflow's UI: the run, the registered version with its alias and the run it
    came from with its dataset inputs. Screenshots in test-artifacts/screenshots/."""
    if _chromium() is None:
        pytest.skip("chromium is not installed (make test installs it with apt-get when run as root)")
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    st = plat.stack
    api = httpx.Client(base_url=st.prefect_api, timeout=30)
    dep = api.get("/deployments/name/capflow-pipeline/nightly").raise_for_status().json()

    def runs() -> list[dict]:
        return api.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [dep["id"]]}}}
                        ).raise_for_status().json()

    before = {r["id"] for r in runs() if r["state"]["type"] != "SCHEDULED"}
    # the server's scheduler turns the cron into scheduled runs (it failed on every loop with SQLAlchemy 2.1:
    # "Can't evaluate bulk DML statement", and the nightly run never came; SQLAlchemy is pinned to 2.0)
    deadline = time.monotonic() + 120
    while not [r for r in runs() if r["state"]["type"] == "SCHEDULED"]:
        assert time.monotonic() < deadline, "the Prefect server scheduled no run of the nightly deployment"
        time.sleep(5)
    name = f"ui-click-{int(time.time())}"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{st.prefect_ui}/deployments", wait_until="networkidle")
        page.get_by_role("link", name="nightly").first.click()
        page.wait_for_load_state("networkidle")
        # the nightly schedule and its next run, as the UI shows them
        page.get_by_text("Upcoming", exact=True).click()
        page.wait_for_timeout(1500)
        page.screenshot(path=str(SHOTS / "prefect-ui-schedule.png"), full_page=True)
        shown = page.inner_text("body")
        (SHOTS / "prefect-ui-schedule.txt").write_text(shown, encoding="utf-8")
        upcoming = [r for r in runs() if r["state"]["type"] == "SCHEDULED"]
        assert "At 02:00 AM" in shown and upcoming, shown[-1500:]  # the cron and the runs it has scheduled
        assert any(r["name"] in shown for r in upcoming), shown[-1500:]  # listed with their start times
        # Run -> Custom run: the form
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_text("Custom run").click()
        page.wait_for_load_state("networkidle")
        page.locator(".flow-run-name-input input").fill(name)
        page.locator(".schema-form-property", has_text="preset (Optional)").locator("textarea").first.fill("tiny")
        students = page.locator(".schema-form-property", has_text="students (Optional)").first
        students.locator("textarea").first.fill("lw")
        overrides = page.locator(".schema-form-property", has_text="overrides (Optional)").first
        overrides.get_by_role("button", name="list", exact=True).click()
        overrides.get_by_role("button", name="Add item").click()
        overrides.locator("textarea").last.fill("run.parallel_students=1")  # in no stage key: the stages stay cached
        page.screenshot(path=str(SHOTS / "prefect-ui-custom-run-form.png"), full_page=True)
        page.get_by_role("button", name="Submit").click()
        deadline = time.monotonic() + 60  # the run the click created (the toast's "View run" link leads there)
        while not (made := [r for r in runs() if r["name"] == name]):
            assert time.monotonic() < deadline, "the Submit click created no flow run"
            time.sleep(1)
        page.goto(f"{st.prefect_ui}/runs/flow-run/{made[0]['id']}", wait_until="networkidle")
        _wait_for_state(page, lambda: api.get(f"/flow_runs/{made[0]['id']}").raise_for_status().json(), 540)
        page.screenshot(path=str(SHOTS / "prefect-ui-run-completed.png"), full_page=True)
        page.get_by_text("Artifacts", exact=True).first.click()
        page.wait_for_timeout(2000)
        page.screenshot(path=str(SHOTS / "prefect-ui-run-artifacts.png"), full_page=True)
        shown = page.inner_text("body")
        (SHOTS / "prefect-ui-run-artifacts.txt").write_text(shown, encoding="utf-8")
        assert "capflow-run-summary" in shown, shown[-3000:]
        # the run exists because of the click, with the form's parameters
        (run,) = [r for r in runs() if r["id"] not in before and r["state"]["type"] != "SCHEDULED"]
        assert run["name"] == name and run["state"]["type"] == "COMPLETED"
        assert run["parameters"] == {"preset": "tiny", "config_path": None, "students": ["lw"], "scst": False,
                                     "overrides": ["run.parallel_students=1"]}
        # MLflow's UI: the run, its dataset input, the registered version, its alias and its source run
        client = plat.client()
        exp = plat.first["experiment_id"]
        (parent,) = client.search_runs([exp], filter_string=f"tags.`prefect.flow_run_id` = '{run['id']}'")
        page.goto(f"{st.mlflow_url}/#/experiments/{exp}/runs/{parent.info.run_id}", wait_until="load")
        _shows(page, "pipeline", run["id"])  # the parent run, tagged with the clicked flow run
        page.screenshot(path=str(SHOTS / "mlflow-ui-clicked-run.png"), full_page=True)
        champ = client.get_model_version_by_alias("capflow-captioner", "champion")
        page.goto(f"{st.mlflow_url}/#/models/capflow-captioner/versions/{champ.version}", wait_until="load")
        _shows(page, "champion", f"Version {champ.version}")
        page.screenshot(path=str(SHOTS / "mlflow-ui-version-alias.png"), full_page=True)
        page.get_by_role("link", name="lw-1x").first.click()  # Source Run: the student's run
        _shows(page, "lw-1x", "test_CIDEr", "dataset")  # its inputs: the dataset lineage
        page.screenshot(path=str(SHOTS / "mlflow-ui-source-run.png"), full_page=True)
        browser.close()


def test_caption_real_images_with_the_champion(plat, external):
    images = sorted((external / "images").glob("*.jpg"))
    assert len(images) == 27
    p = plat.capflow("caption", *map(str, images), "--model", "models:/capflow-captioner@champion", "--json")
    out = json.loads(p.stdout)
    assert [o["file"] for o in out] == [str(i) for i in images]
    # the champion downloaded through the MLflow server (artifacts on S3) captions exactly like the model folder
    # the pipeline wrote (tiny preset, 1 XE epoch: captions may be empty, and are then counted on stderr)
    folders = list((plat.work / ".capflow" / "tiny" / "runs").glob("student-lw-*/model"))
    assert len(folders) == 1
    local = json.loads(plat.capflow("caption", *map(str, images), "--model", str(folders[0]), "--json").stdout)
    assert out == local and all(isinstance(o["caption"], str) for o in out)
    empty = sum(not o["caption"] for o in out)
    assert (f"{empty} of 27 captions are empty" in p.stderr) == (empty > 0)


def test_transient_s3_outage_is_retried(plat):
    """The endpoint goes away and comes back during an upload: the upload succeeds after retries."""
    from captioning.config import load_config
    from tasks.tracking import Tracker

    st = plat.stack
    os.environ["MLFLOW_TRACKING_URI"] = st.mlflow_url
    try:
        tr = Tracker(load_config("tiny", None, [f"run.workdir={plat.work / 'transient'}"]))
        run = tr.start("s3-outage")
        os.killpg(st.pids["s3"], signal.SIGKILL)

        def back():
            time.sleep(2.0)
            st._start("s3", 60)
            st.s3_client().create_bucket(Bucket=st.bucket)

        t = threading.Thread(target=back)
        t.start()
        tr.json_artifact(run, "after-outage.json", {"ok": 1})
        t.join()
        tr.end(run)
        assert st.objects(f"mlflow/{tr.experiment_id}/{run}/artifacts/") == \
            [f"mlflow/{tr.experiment_id}/{run}/artifacts/after-outage.json"]
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        Stack.save(st)


def test_dead_s3_fails_the_run_loudly_and_the_rerun_resumes(plat):
    """S3 dies while a student trains: the run fails with the upload error, the student's epoch checkpoints stay
    on local disk, and after the endpoint is back the re-run resumes them instead of retraining."""
    st = plat.stack
    args = [*RUN_ARGS, "--set", "students.xe.epochs=2", "--json"]
    runs_dir = plat.work / ".capflow" / "tiny" / "runs"
    before = {p.name for p in runs_dir.glob("student-lw-*")}
    proc = subprocess.Popen([*CAPFLOW, "run", *args], cwd=plat.work, env=plat.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    new: list[Path] = []
    while time.monotonic() < deadline and proc.poll() is None:
        new = [p for p in runs_dir.glob("student-lw-*") if p.name not in before]
        if new and list(new[0].glob("xe/**/*.pt")):
            break
        time.sleep(0.1)
    assert new, "the student stage never started"
    os.killpg(st.pids["s3"], signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "failed" in (out + err).lower()
    ckpts = sorted(p.name for p in new[0].glob("xe/**/*.pt"))
    assert ckpts, "local checkpoints were lost"
    # the endpoint comes back (empty: moto keeps nothing), the re-run resumes the student from its checkpoints
    st.pids.pop("s3", None)
    st._start("s3", 60)
    st.s3_client().create_bucket(Bucket=st.bucket)
    res = json.loads(plat.capflow("run", *args).stdout)
    assert res["failed"] == []
    student = plat.client().search_runs([res["experiment_id"]], filter_string="tags.`mlflow.runName` = 'lw-1x'",
                                        order_by=["attributes.start_time DESC"])[0]
    assert student.data.metrics["xe_resumed_from_epoch"] >= 1


def test_stack_down_leaves_no_process_or_port(plat):
    st = plat.stack
    procs = _stack_processes(Stack.load(plat.home))
    assert len(procs) >= 4
    p = plat.capflow("stack", "down", "--home", str(plat.home), "--json")
    assert json.loads(p.stdout)["ports_still_in_use"] == []
    _gone, alive = psutil.wait_procs(procs, timeout=10)
    assert alive == []
    # nothing listens on the stack's ports any more, and a server could bind them again (SO_REUSEADDR, as
    # servers do: connections of the stopped servers may still sit in TIME_WAIT)
    listening = {c.laddr.port for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert not listening & set(st.ports.values())
    assert all(port_free(port) for port in st.ports.values())
    status = plat.capflow("stack", "status", "--home", str(plat.home), "--json", check=False)
    assert status.returncode == 1 and json.loads(status.stdout)["running"] is False
    assert (plat.home / "s3" / "capflow-test").is_dir()  # the bucket's objects were kept for the next `up`
