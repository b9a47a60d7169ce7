"""The rank side's data path of a recovery: the state carried across a regroup and the heal.

* :mod:`.carry` -- the trainer's state at its last committed boundary, exported (shared, not
  copied) and imported into a rebuilt trainer, consuming the carry tensor by tensor;
* :mod:`.tensor_stream` -- a nested state sent point to point, tensor by tensor, in bounded
  buckets straight into the receiver's buffers, each message checksummed and deadlined;
* :mod:`.checksum` -- the cheap, exact per-bucket checksum, on the tensor's device;
* :mod:`.heal` -- who heals whom, the transfer, and the wait of every member for the heals;
* :mod:`.memory` -- freed memory given back to the OS after a recovery.
"""
