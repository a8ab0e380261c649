"""Reports that run compiled steps and summarise what a plan did to training."""
from .precision import PrecisionReport, precision_report

__all__ = ["PrecisionReport", "precision_report"]
