"""How the explorer's board and micro-batch controls follow one another: a fresh board for a device count (a V
under a V-shape schedule), the stage cuts kept through a drop, a V-shape schedule laying the layers out as a V, the
slider and the sizes box. A part of PipelineExplorer, kept apart as explorer_run is."""
from __future__ import annotations

from ..core.placement import Placement
from ..runtime.devices import get_devices
from .layout import V_SCHEDULES, is_v, kept_cuts, v_layout, with_turn
from .refusals import read_sizes


class BoardFollows:
    """PipelineExplorer's board handlers (it holds the widgets; `_quiet` set while it sets several at once)."""

    def _layout(self, devices: list[str], schedule: str) -> Placement:
        """A fresh board: the V for a V-shape schedule (where there are layers enough), else an even split."""
        if schedule in V_SCHEDULES and 2 * len(devices) <= len(self.model.layer_names):
            return v_layout(self.model.layer_names, devices)
        return Placement.even(self.model, devices)

    def _resize(self, change) -> None:
        """A new device count splits the layers evenly (as many on each device; a V under a V-shape schedule)."""
        if not self._quiet:
            self._place(self._layout([d.name for d in get_devices(change["new"])], self.schedule_menu.value))

    def _board_changed(self, _=None) -> None:
        """A drop: the cuts that still separate two layers on one device stay (under a V-shape schedule, the V's
        turn is cut where one cut short of a V), then the redraw."""
        if self._quiet:
            return
        layers, assignment = self.model.layer_names, self.board.assignment
        cuts = (with_turn if self.schedule_menu.value in V_SCHEDULES else kept_cuts)(layers, assignment,
                                                                                   self.board.cuts)
        if cuts != list(self.board.cuts):
            self._quiet = True
            try:
                self.board.cuts = cuts
            finally:
                self._quiet = False
        self._update()

    def _schedule_picked(self, change) -> None:
        """A V-shape schedule lays the layers out as a V, unless the board is one already; the learner may drag on."""
        if self._quiet:
            return
        layers, assignment, devices = self.model.layer_names, self.board.assignment, self.board.devices
        if change["new"] in V_SCHEDULES and 2 * len(devices) <= len(layers) and not is_v(layers, assignment,
                                                                                           self.board.cuts):
            self._place(v_layout(layers, devices))
        else:
            self._update()

    def _slider_moved(self, _=None) -> None:
        """The slider sets equal micro-batches: moving it empties the sizes box."""
        if self._quiet:
            return
        self._set_board(self.board.devices, self.board.assignment, [(self.sizes, "")], self.board.cuts)

    def _sizes_typed(self, _=None) -> None:
        """Unequal sizes: the slider follows their count where it offers it."""
        if self._quiet:
            return
        try:
            sizes = read_sizes(self.sizes.value, self.batch.inputs.shape[1])
        except ValueError:
            sizes = None
        follow = [(self.micro_batches, len(sizes))] if sizes and len(sizes) in self.micro_batches.options else []
        self._set_board(self.board.devices, self.board.assignment, follow, self.board.cuts)
