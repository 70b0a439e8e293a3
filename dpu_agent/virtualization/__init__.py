"""Virtualization offload: functions handed to the host or its guests.

A function (an SR-IOV VF, a scalable function, a virtio-net/virtio-blk device or an
NVMe controller) is seen by the host as a device and by the DPU as a representor
port, on which the network service's flow rules act; a block function also exposes
a volume of the volume store. `FunctionManager` keeps the records and the
transactions; a `FunctionBackend` makes the devices (`linux` for plain Linux and the
test VM, `bluefield` for hardware, `memory` for unit tests of the layers above).
"""
