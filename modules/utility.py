"""The public names earlier code, the README and the notebook import from here, now each in the
module whose job it is: evaluation, model files, prediction and reports."""
from modules.evaluation import evaluate
from modules.model_files import FORMAT_NAME, FORMAT_VERSION, load_model, save_model
from modules.prediction import predict
from modules.report import (
                            ACCURACY_PNG,
                            COMPARISON_HTML,
                            LOSS_PNG,
                            comparison_figure,
                            plot_comparison,
                            results_table,
                            table_markdown,
)

__all__ = ["ACCURACY_PNG", "COMPARISON_HTML", "FORMAT_NAME", "FORMAT_VERSION", "LOSS_PNG",
           "comparison_figure", "evaluate", "load_model", "plot_comparison", "predict",
           "results_table", "save_model", "table_markdown"]
