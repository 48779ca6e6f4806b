# Turns a text file into a C source defining NAME_data / NAME_len (NAME
# defaults to kv_corpus).
if(NOT NAME)
  set(NAME kv_corpus)
endif()
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" n)
math(EXPR len "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "((0x..,){24})" "\\1\n" body "${body}")
get_filename_component(src ${IN} NAME)
file(WRITE ${OUT} "/* generated from ${src} by tools/embed.cmake */\n#include <stddef.h>\nconst unsigned char ${NAME}_data[] = {\n${body}0x00};\nconst size_t ${NAME}_len = ${len};\n")
