"""Run records (the source of truth) and the loggers that mirror them."""

# ``logger=<name>``: the module and class of each mirror, imported only when used
MIRRORS = {"wandb": ("normexp.tracking.wandb", "WandbMirror"),
           "mlflow": ("normexp.tracking.mlflow", "MlflowMirror")}
