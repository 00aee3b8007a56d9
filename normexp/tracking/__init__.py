"""Run records (the source of truth) and the loggers that mirror them."""

# ``logger=<name>``: the module and class of the logger (a mirror of the record), imported only when used
LOGGER_CLASSES = {"wandb": ("normexp.tracking.wandb", "WandbMirror"),
                  "mlflow": ("normexp.tracking.mlflow", "MlflowMirror")}
