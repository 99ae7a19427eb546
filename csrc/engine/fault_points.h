// Fault points: places where a test makes the code fail as the system can (a thread that cannot
// start, an allocation refused), so the paths that handle such failures are tested. Unarmed, a
// pass costs one relaxed atomic load.
#pragma once

namespace mlkv {

enum class FaultPoint : int {
  kThreadStart,        // starting a background thread (StartThread)
  kReadAheadSlotList,  // allocating the slot list of a batch read ahead into slots
};

// Makes the `pass`-th pass through `point` from now fail (1: the next one); 0 disarms it. Tests only.
void ArmFaultForTesting(FaultPoint point, int pass);

// Throws std::system_error, as the failing system call would, when this is the armed pass.
void PassFaultPoint(FaultPoint point);

}  // namespace mlkv
