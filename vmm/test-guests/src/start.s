/* Boot code shared by every test guest. Everything here runs at CPL 0, which the PVM
 * hypervisor emulates slowly, so it does the minimum: record the entry state, install our
 * own GDT, an empty IDT (any exception then triple-faults) and 4 GiB of identity-mapped,
 * user-accessible 2 MiB pages, then iretq to CPL 3 with IOPL 3 and IF=0 and call main. */

    .set BR_KIND,   0
    .set BR_RBX,    8
    .set BR_RSI,    16
    .set BR_CR0,    24
    .set BR_CR3,    32
    .set BR_CR4,    40
    .set BR_EFER,   48
    .set BR_RFLAGS, 56
    .set BR_CS,     64
    .set BR_DS,     72
    .set BR_SS,     80
    .set BR_ES,     88
    .set BR_GDTR,   96      /* limit u16, then base (u32 from 32-bit code, u64 from 64-bit) */

    .set CR0_VALUE, 0x80010033  /* PG | WP | NE | ET | MP | PE; EM and TS clear */
    .set CR4_BITS,  0x620       /* OSXMMEXCPT | OSFXSR | PAE */
    .set MSR_EFER,  0xC0000080

    .section .note.Xen, "a"
    .balign 4
    .long 4                     /* namesz */
    .long 4                     /* descsz */
    .long 18                    /* XEN_ELFNOTE_PHYS32_ENTRY */
    .asciz "Xen"
    .long _start32

    .section .text.boot, "ax"

/* PVH entry: 32-bit protected mode, paging off, EBX = hvm_start_info. */
    .code32
    .global _start32
_start32:
    movl %ebx, %edi
    movl %esi, %ebp
    movl $1, %eax
    xchgl %eax, boot_claimed    /* first vCPU here is the BSP (xchg leaves EFLAGS alone) */
    movl $boot_stack_top, %esp
    pushfl
    testl %eax, %eax
    jnz ap_park32
    popl dsec_boot_regs + BR_RFLAGS
    movl %edi, dsec_boot_regs + BR_RBX
    movl %ebp, dsec_boot_regs + BR_RSI
    movw %cs, dsec_boot_regs + BR_CS
    movw %ds, dsec_boot_regs + BR_DS
    movw %ss, dsec_boot_regs + BR_SS
    movw %es, dsec_boot_regs + BR_ES
    movl %cr0, %eax
    movl %eax, dsec_boot_regs + BR_CR0
    movl %cr3, %eax
    movl %eax, dsec_boot_regs + BR_CR3
    movl %cr4, %eax
    movl %eax, dsec_boot_regs + BR_CR4
    movl $MSR_EFER, %ecx
    rdmsr
    movl %eax, dsec_boot_regs + BR_EFER
    movl %edx, dsec_boot_regs + BR_EFER + 4
    sgdtl dsec_boot_regs + BR_GDTR
    movl $1, dsec_boot_regs + BR_KIND

    call mask_interrupts
    lgdtl gdt_ptr
    lidtl idt_null
    movl %cr4, %eax
    orl $CR4_BITS, %eax
    movl %eax, %cr4
    movl $pml4, %eax
    movl %eax, %cr3
    movl $MSR_EFER, %ecx
    rdmsr
    orl $0x100, %eax            /* LME */
    wrmsr
    movl $CR0_VALUE, %eax
    movl %eax, %cr0
    ljmpl $0x08, $long_common

/* Mask both 8259 PICs (same bytes in 32- and 64-bit mode). */
mask_interrupts:
    movb $0xff, %al
    outb %al, $0x21
    outb %al, $0xa1
    ret

ap_park32:
    cli
1:  hlt
    jmp 1b

/* Linux 64-bit boot protocol entry (ELF e_entry): long mode, RSI = boot_params. */
    .code64
    .global _start64
_start64:
    movq %rbx, %rdi
    movq %rsi, %rbp
    movl $1, %eax
    xchgl %eax, boot_claimed(%rip)
    movq $boot_stack_top, %rsp
    pushfq
    testl %eax, %eax
    jnz ap_park64
    popq dsec_boot_regs + BR_RFLAGS(%rip)
    movq %rdi, dsec_boot_regs + BR_RBX(%rip)
    movq %rbp, dsec_boot_regs + BR_RSI(%rip)
    movw %cs, dsec_boot_regs + BR_CS(%rip)
    movw %ds, dsec_boot_regs + BR_DS(%rip)
    movw %ss, dsec_boot_regs + BR_SS(%rip)
    movw %es, dsec_boot_regs + BR_ES(%rip)
    movq %cr0, %rax
    movq %rax, dsec_boot_regs + BR_CR0(%rip)
    movq %cr3, %rax
    movq %rax, dsec_boot_regs + BR_CR3(%rip)
    movq %cr4, %rax
    movq %rax, dsec_boot_regs + BR_CR4(%rip)
    movl $MSR_EFER, %ecx
    rdmsr
    movl %eax, dsec_boot_regs + BR_EFER(%rip)
    movl %edx, dsec_boot_regs + BR_EFER + 4(%rip)
    sgdt dsec_boot_regs + BR_GDTR(%rip)
    movq $2, dsec_boot_regs + BR_KIND(%rip)

    call mask_interrupts
    lgdt gdt_ptr(%rip)
    lidt idt_null(%rip)
    movq %cr4, %rax
    orq $CR4_BITS, %rax
    movq %rax, %cr4
    movq $pml4, %rax
    movq %rax, %cr3
    movq $CR0_VALUE, %rax
    movq %rax, %cr0
    pushq $0x08
    pushq $long_common
    lretq

ap_park64:
    cli
1:  hlt
    jmp 1b

long_common:
    movl $0x10, %eax
    movl %eax, %ds
    movl %eax, %es
    movl %eax, %ss
    movl %eax, %fs
    movl %eax, %gs
 /* Our own TSS whose I/O bitmap allows every port: the PVM hypervisor checks the TSS
  * bitmap for port I/O at CPL 3 even with IOPL 3, and the VMM's boot TSS has none. */
    movl $tss, %eax
    movw %ax, gdt_tss + 2
    shrl $16, %eax
    movb %al, gdt_tss + 4
    movb %ah, gdt_tss + 7
    movw $0x28, %ax
    ltr %ax
    movq $boot_stack_top, %rsp
    pushq $0x1b                 /* SS: user data */
    pushq $user_stack_top       /* RSP */
    pushq $0x3002               /* RFLAGS: IOPL 3, IF 0 */
    pushq $0x23                 /* CS: user code64 */
    pushq $user_entry           /* RIP */
    iretq

/* From here on: CPL 3, native speed. */
user_entry:
    movq dsec_boot_regs + BR_KIND(%rip), %rsi
    movq dsec_boot_regs + BR_RBX(%rip), %rdi
    cmpq $1, %rsi
    je 1f
    movq dsec_boot_regs + BR_RSI(%rip), %rdi
1:  call main
    ud2

/* The freestanding runtime has no libc: these are what the compiler may call. */
    .text
    .global memcpy
memcpy:
    movq %rdi, %rax
    movq %rdx, %rcx
    rep movsb
    ret

    .global memset
memset:
    movq %rdi, %r9
    movl %esi, %eax
    movq %rdx, %rcx
    rep stosb
    movq %r9, %rax
    ret

    .global memmove
memmove:
    movq %rdi, %rax
    movq %rdx, %rcx
    cmpq %rsi, %rdi
    jbe 1f                      /* dst <= src: forward copy is safe */
    leaq (%rsi, %rdx), %r8
    cmpq %r8, %rdi
    jae 1f                      /* no overlap */
    leaq -1(%rdi, %rdx), %rdi
    leaq -1(%rsi, %rdx), %rsi
    std
    rep movsb
    cld
    ret
1:  rep movsb
    ret

    .global memcmp
    .global bcmp
memcmp:
bcmp:
    xorl %eax, %eax
    testq %rdx, %rdx
    jz 2f
1:  movzbl (%rdi), %eax
    movzbl (%rsi), %ecx
    subl %ecx, %eax
    jnz 2f
    incq %rdi
    incq %rsi
    decq %rdx
    jnz 1b
2:  ret

    .data
    .balign 16
gdt:
    .quad 0
    .quad 0x00af9a000000ffff    /* 0x08 kernel code, 64-bit */
    .quad 0x00cf92000000ffff    /* 0x10 kernel data */
    .quad 0x00cff2000000ffff    /* 0x18 user data (selector 0x1b) */
    .quad 0x00affa000000ffff    /* 0x20 user code, 64-bit (selector 0x23) */
gdt_tss:                        /* 0x28 64-bit TSS; base filled in at boot */
    .word tss_end - tss - 1
    .word 0
    .byte 0
    .byte 0x89                  /* present, available 64-bit TSS */
    .byte 0
    .byte 0
    .quad 0
gdt_end:
    .balign 16
gdt_ptr:
    .word gdt_end - gdt - 1
    .quad gdt
    .balign 16
idt_null:
    .word 0
    .quad 0

    .balign 4
boot_claimed:
    .long 0
    .balign 16
    .global dsec_boot_regs
dsec_boot_regs:
    .fill 16, 8, 0

/* 64-bit TSS: RSP0 (unused: no interrupts or exceptions are handled) and an all-zero I/O
 * permission bitmap (every port allowed), terminated by 0xff. */
    .balign 16
tss:
    .long 0
    .quad boot_stack_top
    .fill 0x66 - 12, 1, 0
    .word tss_iomap - tss
tss_iomap:
    .fill 8192, 1, 0
    .byte 0xff
tss_end:

/* Identity map of the first 4 GiB with 2 MiB pages, user-accessible at every level. */
    .section .data.pagetables, "aw"
    .balign 4096
pml4:
    .quad pdpt + 0x7
    .fill 511, 8, 0
/* Exported so a guest can map more (the pmem guest adds its window above 4 GiB). */
    .global dsec_pdpt
dsec_pdpt:
pdpt:
    .quad pd + 0x7
    .quad pd + 0x1000 + 0x7
    .quad pd + 0x2000 + 0x7
    .quad pd + 0x3000 + 0x7
    .fill 508, 8, 0
pd:
    .set page, 0
    .rept 2048
    .quad page + 0x87           /* P | RW | US | PS */
    .set page, page + 0x200000
    .endr

    .bss
    .balign 16
boot_stack:
    .skip 512
boot_stack_top:
    .balign 16
user_stack:
    .skip 256 * 1024
    .global user_stack_top
user_stack_top:
