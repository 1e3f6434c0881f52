from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.rule import FixSpec, Rule
from ampdoctor.lint.semantic import autocast as acs
from ampdoctor.lint.semantic import branches
from ampdoctor.lint.semantic import edits
from ampdoctor.lint.semantic import source

_CONSEQUENCE = {
    "init_scale": "the first `scale()` raises TypeError",
    "enabled": "entering the region raises TypeError",
}


class DeviceStringToDeviceAmp(Rule):
    """A device string passed to ``torch.cuda.amp``'s GradScaler or autocast, which take none."""

    code = "AMP313"
    name = "device-string-to-device-amp"
    severity = Severity.ERROR
    in_tests = True  # a crash whatever the test intends
    message = ("`{call}` passes {string} as `{param}`: the device-specific API takes no device, so "
               "{consequence}. Use `{new}` (the device-generic API), which takes the device first.")
    fix_title = "Use the device-generic `torch.amp` API, which takes the device"
    fix_availability = "unsafe"
    words = (b"cuda.amp", b"cpu.amp", b"import amp")
    summary = "`torch.cuda.amp.GradScaler(\"cuda\")`/`autocast(\"cuda\")`: the string becomes `init_scale`/`enabled` and raises."

    def visit_Call(self, node: cst.Call) -> None:
        hit = acs.device_string_misplaced(self.ctx.names, node)
        if hit is None or branches.in_version_guard(self.ctx):
            return  # under a torch-version test, the old torch's branch is meant for it
        param, string = hit
        kind = "GradScaler" if param == "init_scale" else "autocast"
        torch_name, imports = edits.torch_local(self.ctx.names)
        # torch.amp.GradScaler(device, init_scale, ...) keeps the rest of the arguments in place;
        # torch.amp.autocast(device_type, dtype, enabled, ...) does only for keywords
        rest = node.args[1:]
        fix = None
        if kind == "GradScaler" or all(a.keyword is not None or a.star == "**" for a in rest):
            new = node.with_changes(func=edits.attr_chain(f"{torch_name}.amp.{kind}"))
            fix = FixSpec(((node, new),), safe=False, title=self.fix_title, imports=imports)
        msg = self.message.format(call=source.short(node, 50), string=f'"{string}"', param=param,
                                  consequence=_CONSEQUENCE[param], new=f'torch.amp.{kind}("{string}", ...)')
        self.report(node, msg, fix)
