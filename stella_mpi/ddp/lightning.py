"""PyTorch Lightning's DDP strategy with stella's hook on every device.

Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers a communication
hook only when the model is on a CUDA device; on CPU it drops the hook without a word, and DDP
then sends dense gradients with torch's own allreduce. :class:`StellaDDPStrategy` takes the same
arguments and registers the hook on CPU too (on CUDA it is Lightning's own behaviour)::

    from stella_mpi import ddp
    ddp.init_process_group()
    state = ddp.StellaHookState(lightning_module, compression=hvd.Compression.cacheaware(density=0.01))
    trainer = L.Trainer(strategy=ddp.lightning.StellaDDPStrategy(ddp_comm_state=state,
                                                                  ddp_comm_hook=ddp.stella_hook), ...)

Importing this module needs ``lightning`` (``pip install stella_mpi[lightning]``).
"""
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy

from .hook import StellaHookState


class StellaDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose communication hook is registered on CPU as on CUDA."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        state = getattr(self, "_ddp_comm_state", None)
        if self._ddp_comm_hook is not None and state is not None and not isinstance(state, StellaHookState) \
                and getattr(self._ddp_comm_hook, "__module__", "") == "stella_mpi.ddp.hook":
            raise TypeError("StellaDDPStrategy: ddp_comm_state must be a stella_mpi.ddp.StellaHookState for "
                            "stella_hook, got %s" % type(state).__name__)

    def _register_ddp_hooks(self):
        if self.root_device.type == "cuda":
            return super()._register_ddp_hooks()
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)
        return None
