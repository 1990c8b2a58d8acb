"""MLflow params never carry credentials: credential-like keys are dropped, passwords inside URLs are masked."""

from tasks.tracking import flatten


def test_flatten_drops_credential_keys_and_masks_url_passwords():
    cfg = {"tracking": {"tracking_uri": "postgresql://bob:s3cr3t@db:5432/mlflow", "experiment": None},
           "store": {"aws_secret_access_key": "abc", "api_token": "t", "endpoint": "http://minio:9000/x"},
           "flags": [1, 2], "on": True}
    out = flatten(cfg)
    assert out == {"tracking.tracking_uri": "postgresql://bob:***@db:5432/mlflow", "tracking.experiment": "null",
                   "store.endpoint": "http://minio:9000/x", "flags": "[1, 2]", "on": "true"}
    assert not any("s3cr3t" in v or v in ("abc", "t") for v in out.values())
