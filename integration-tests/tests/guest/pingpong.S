/* Real-mode ping-pong guest for tests/kick_paths.rs (pv_wait / pv_kick, many rounds).
 * Loaded at GPA 0x1000 with CS base 0; the kicker (vCPU0) enters at `kicker`, the waiter
 * (vCPU1) at `waiter`. Data (32-bit slots):
 *   0x2000 target vCPU    0x2004 rounds        0x2008 ready (waiter, round)
 *   0x200c kicked (kicker, round, before the OUT)  0x2010 spurious wakes (waiter)
 *   0x2014 order: 0 = kick while halted, 1 = kick before the halt
 *   0x2018 ack (waiter, round, after waking)  0x201c rung (kicker, round, after the OUT)
 * Rounds count from 1. Rebuild the bytes in kick_paths.rs with:
 *   as --32 -o p.o pingpong.S && objcopy -O binary -j .text p.o p.bin && xxd -i p.bin
 *   nm p.o   (entry offsets)
 */
.code16
.text
kicker:
  xor %ecx, %ecx
k_loop:
  inc %ecx
  cmp 0x2004, %ecx
  ja k_done
k_wait_ready:
  cmp %ecx, 0x2008
  jne k_wait_ready
  mov %ecx, 0x200c
  mov 0x2000, %eax
  mov $0x0a40, %dx
  out %eax, %dx
  mov %ecx, 0x201c
k_wait_ack:
  cmp %ecx, 0x2018
  jne k_wait_ack
  jmp k_loop
k_done:
  mov $0x602, %dx
  out %al, %dx
k_park:
  hlt
  jmp k_park

waiter:
  xor %ecx, %ecx
w_loop:
  inc %ecx
  cmp 0x2004, %ecx
  ja w_done
  mov %ecx, 0x2008
  cmpl $0, 0x2014
  je w_halt
w_wait_rung:
  cmp %ecx, 0x201c
  jne w_wait_rung
w_halt:
  cli
  hlt
  cmp %ecx, 0x200c
  je w_ok
  incl 0x2010
  jmp w_halt
w_ok:
  mov %ecx, 0x2018
  jmp w_loop
w_done:
  mov $0x601, %dx
  out %al, %dx
w_park:
  hlt
  jmp w_park
