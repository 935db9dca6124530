"""The asynchronous trainer: PipeDream and PipeDream-2BW (``--schedule pipedream``).

Weights change inside a step, so a run is a sequence of streams without a flush
(``trainer.AsyncTrainer``), each micro-batch using the weight version its schedule gives
(``weights``). ``plan`` resolves and checks the streams, ``loop.train_async`` runs them
with the synchronous trainer's data, optimizer and outputs, and ``reference`` replays the
same versions in one process for the tests.
"""

from pipetrain.train.pipedream.loop import train_async
from pipetrain.train.pipedream.trainer import AsyncTrainer, StreamResult, predicted_versions

__all__ = ["AsyncTrainer", "StreamResult", "predicted_versions", "train_async"]
