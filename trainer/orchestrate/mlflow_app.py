"""The MLflow server ``trainpipe up`` runs: MLflow's own app with its basic auth, opening in the model-training view.

MLflow 3 (3.17 here) opens an experiment in the view its GenAI / Model training switch holds, which each browser
keeps in its local storage (``mlflow.workflowType_v1``) and which starts on GenAI; the experiment's
``mlflow.experimentKind`` tag no longer decides it. trainpipe's links name the view (``tracking.ML_VIEW``); for a
person who opens the UI without one, the page this server sends sets the switch to Model training when the
browser has no choice of its own yet. A choice made with the switch is kept.

Registered as the ``mlflow.app`` entry point ``trainpipe`` (pyproject.toml) and started with
``mlflow server --app-name trainpipe``.
"""

from __future__ import annotations

STORAGE_KEY = "mlflow.workflowType_v1"
_SET = f"localStorage.getItem('{STORAGE_KEY}')||localStorage.setItem('{STORAGE_KEY}','\"machine_learning\"')"
OPEN_IN_MODEL_TRAINING = f"<script>try{{{_SET}}}catch(e){{}}</script>".encode()


def create_app():
    """MLflow's Flask app with the page hook below, then MLflow's basic-auth factory (``--app-name basic-auth``)."""
    from mlflow.server import app
    from mlflow.server.auth import create_app as with_basic_auth

    app.after_request(open_in_model_training)
    return with_basic_auth(app)


def open_in_model_training(response):
    """The UI's page, its first script setting the view switch to Model training unless the browser has set it."""
    from flask import request

    if request.path not in ("/", "/index.html") or response.status_code != 200 or response.mimetype != "text/html":
        return response
    response.direct_passthrough = False  # a file response: read it here to change it
    body = response.get_data()
    if b"<head>" in body and OPEN_IN_MODEL_TRAINING not in body:
        response.set_data(body.replace(b"<head>", b"<head>" + OPEN_IN_MODEL_TRAINING, 1))
        # A copy cached before this hook would be revalidated by its ETag and kept: this page has none.
        for header in ("ETag", "Last-Modified"):
            response.headers.pop(header, None)
    return response
