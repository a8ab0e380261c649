"""The error the pipeline split raises for a step it cannot cut (a refused option is ``PassOptionError``)."""


class PipelineSplitError(ValueError):
    pass
